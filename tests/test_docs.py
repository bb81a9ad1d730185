"""The documentation site (mkdocs.yml, docs/, tools/docs_hooks.py) and the README.

- The site builds with `mkdocs build --strict` in under 2 minutes: a broken link, a missing anchor,
  a `::: path` naming a symbol that no longer exists, or a public name without an API entry or a
  docstring (the hook's API check) fails it.
- The shell commands the guides mark for the docs test (an `<!-- docs-test -->` or
  `<!-- docs-test: slow -->` line right before a ```bash block) run and exit 0 (a `--help` call:
  0 or absl's 1, with its flags listed), so the guides cannot drift from the scripts' flags.
- The README stays a short front door that keeps CI's test command.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
BUILD_LIMIT_S = 120
_MARKED = re.compile(r"^<!-- docs-test(?P<slow>: slow)? -->\n```bash\n(?P<body>.*?)\n```$",
                     re.M | re.S)


def _hooks():
  spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "tools" / "docs_hooks.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _env(tmp_path) -> dict:
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1", JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path),
             MAVERICK_CACHE_DIR=str(tmp_path / "cache"))
  env.pop("XLA_FLAGS", None)
  return env


def marked_commands() -> list:
  """(page, command block, slow) for every marked ```bash block under docs/."""
  found = []
  for page in sorted(DOCS.rglob("*.md")):
    text = page.read_text()
    blocks = list(_MARKED.finditer(text))
    assert len(blocks) == len(re.findall(r"^<!-- docs-test", text, re.M)), (
        f"{page}: a docs-test marker must stand right before a ```bash block")
    found += [(page.relative_to(REPO).as_posix(), m.group("body"), bool(m.group("slow")))
              for m in blocks]
  return found


def _params():
  return [pytest.param(body, id=f"{page}:{i}",
                       marks=[pytest.mark.slow] if slow else [])
          for i, (page, body, slow) in enumerate(marked_commands())]


def test_site_builds_strictly_in_time(tmp_path):
  site = tmp_path / "site"
  start = time.monotonic()
  p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
                     cwd=REPO, env=_env(tmp_path), capture_output=True, text=True,
                     timeout=BUILD_LIMIT_S + 60)
  took = time.monotonic() - start
  assert p.returncode == 0, p.stderr[-4000:]
  assert took < BUILD_LIMIT_S, f"the site took {took:.0f} s to build"
  home = (site / "index.html").read_text()
  assert "Two commands" in home and "About this site" in home  # the README is the home page
  api = (site / "api" / "maverick" / "index.html").read_text()
  assert "maverick.loading.load" in api and "maverick.generation.generate" in api
  bench = (site / "benchmarks" / "index.html").read_text()
  assert "<!-- result:" not in bench and "fp8_parity_maverick.json" in bench
  assert (site / "results" / "serving_cpu.png").is_file()
  assert (site / "notebooks" / "quickstart" / "index.html").is_file()


@pytest.mark.slow  # the strict build runs the same check; this names the miss directly
def test_every_public_name_is_in_the_api_reference():
  hooks = _hooks()
  names = hooks.public_names()
  assert "maverick.load" in names and "spec_decode.generate" in names
  assert "pallas_kernels.gemm.api.gemm" in names
  assert hooks.api_problems(names, hooks.documented_paths(DOCS / "api")) == []


def test_the_api_check_reports_a_missing_entry_and_a_missing_docstring():
  hooks = _hooks()
  names = {"pkg.a": "pkg.mod.a", "pkg.b": "pkg.mod.b", "pkg.c": "pkg.c"}
  problems = hooks.api_problems(names, {"pkg.mod.a", "pkg.c"},
                                docstring=lambda path: path != "pkg.c")
  assert len(problems) == 2
  assert "pkg.b" in problems[0] and "not in the API reference" in problems[0]
  assert "pkg.c" in problems[1] and "no docstring" in problems[1]


def test_markers_are_found_and_cover_fast_and_slow_commands():
  commands = marked_commands()
  pages = {page for page, _, _ in commands}
  assert {"docs/guides/serving.md", "docs/guides/sharding.md",
          "docs/getting-started.md"} <= pages
  assert any(slow for *_, slow in commands) and any(not slow for *_, slow in commands)


@pytest.mark.parametrize("body", _params())
def test_marked_command_runs(body, tmp_path):
  script = body.replace(".venv/bin/python", shlex.quote(sys.executable))
  p = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=REPO, env=_env(tmp_path),
                     capture_output=True, text=True, timeout=600)
  out = p.stdout + p.stderr
  if body.endswith(" --help"):
    # absl's --help exits with status 1 (argparse's with 0): either, with the flags listed.
    assert p.returncode in (0, 1) and "--" in p.stdout and "Traceback" not in out, out[-3000:]
  else:
    assert p.returncode == 0, f"{body}\n{out[-4000:]}"


def test_readme_is_a_short_front_door():
  text = (REPO / "README.md").read_text()
  lines = text.splitlines()
  assert len(lines) <= 200, len(lines)
  ci_line = [line for line in lines if line.startswith("bash tools/setup.sh test")]
  assert ci_line == ["bash tools/setup.sh test && .venv/bin/python -m pytest -q -n 2 "
                     "--durations=25 tests"]
  assert not re.search(r"\b[Ii]ssue \d+|First GPU run|in progress", text)
  for guide in ("guides/serving.md", "guides/nvidia-record.md", "guides/gpu.md"):
    assert f"](docs/{guide})" in text, guide


@pytest.mark.slow
def test_readme_library_example_runs(tmp_path):
  """The README's library example (its first python block) runs as shown, assert included."""
  text = (REPO / "README.md").read_text()
  example = re.search(r"```python\n(.*?)```", text, re.S).group(1)
  assert "maverick.load()" in example and "assert spec.tokens == out.tokens" in example
  p = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, env=_env(tmp_path),
                     capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stderr[-3000:]
