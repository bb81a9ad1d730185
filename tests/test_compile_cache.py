"""The persistent compilation cache of the CLI scripts (maverick/cli.py): on by default under
$MAVERICK_CACHE_DIR/jax_compile, moved or turned off by --compile_cache_dir, and a second identical
run loads every program from disk instead of compiling it (counted from JAX's own monitoring
events, not timed) and its generate loop from the exported-program cache instead of tracing it
(maverick/program_cache.py, tested on its own in test_program_cache.py)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

from param_utils import single_device_env

REPO = pathlib.Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"(\d+) of (\d+) programs loaded from the compilation cache")

# A process that turns the cache on the way the scripts do, then compiles two programs.
_SNIPPET = """
import sys
from maverick import cli
cli.enable_compile_cache(sys.argv[1])
import jax, jax.numpy as jnp
x = jnp.arange(12.0).reshape(3, 4)
print(jax.jit(lambda a: jnp.tanh(a) @ a.T)(x).sum(), jax.jit(lambda a: a.max(0))(x).sum())
print(cli.compile_cache_summary())
"""


def _env(cache_root):
  env = single_device_env()
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the test session's shared cache would win
  env["MAVERICK_CACHE_DIR"] = str(cache_root)
  return env


def _entries(directory: pathlib.Path) -> dict:
  """{cache entry name: its bytes} (JAX also keeps `-atime` files, rewritten on every read)."""
  if not directory.is_dir():
    return {}
  return {p.name: p.read_bytes() for p in directory.iterdir() if p.name.endswith("-cache")}


def _summary(stdout: str):
  m = SUMMARY.search(stdout)
  assert m, stdout
  return int(m.group(1)), int(m.group(2))


def test_second_process_loads_every_program_from_the_cache(tmp_path):
  run = lambda: subprocess.run([sys.executable, "-c", _SNIPPET, str(tmp_path / "cc")], cwd=REPO,
                               env=_env(tmp_path), capture_output=True, text=True, timeout=120)
  first = run()
  assert first.returncode == 0, first.stderr
  hits, compiled = _summary(first.stdout)
  assert hits == 0 and compiled >= 2
  written = _entries(tmp_path / "cc")
  assert len(written) == compiled
  second = run()
  assert second.returncode == 0, second.stderr
  assert _summary(second.stdout) == (compiled, compiled)
  assert second.stdout.splitlines()[0] == first.stdout.splitlines()[0]  # same results
  assert _entries(tmp_path / "cc") == written


@pytest.mark.slow
def test_generate_script_caches_by_default_and_obeys_the_flag(tmp_path):
  """scripts/generate.py (speculative, the default): the default directory fills on the first
  run, the second run loads every program from it and writes nothing; --compile_cache_dir=
  turns the cache off and --compile_cache_dir=DIR moves it."""
  root = tmp_path / "root"
  default_dir = root / "jax_compile"

  def run(*flags):
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"),
                        "--prompt=def add(a, b):", "--max_new_tokens=6", *flags], cwd=REPO,
                       env=_env(root), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return r.stdout

  first = run()
  hits, compiled = _summary(first)
  assert hits == 0 and compiled >= 1
  assert "0 of 1 loops without tracing" in first
  written = _entries(default_dir)
  assert len(written) == compiled
  assert any(name.startswith("jit__spec_generate") for name in written), sorted(written)
  exported = sorted(p.name for p in (default_dir / "exported").iterdir())
  assert len(exported) == 1 and exported[0].startswith("spec_generate-"), exported

  second = run()
  assert _summary(second) == (compiled, compiled)
  assert "1 of 1 loops without tracing" in second  # not traced again
  text = lambda out: out.split("\n[")[0]  # the continuation, before the stats line
  acceptance = lambda out: [l for l in out.splitlines() if "acceptance length" in l]
  assert text(second) == text(first) and acceptance(second) == acceptance(first) != []
  assert _entries(default_dir) == written
  assert sorted(p.name for p in (default_dir / "exported").iterdir()) == exported

  off = run("--compile_cache_dir=")
  assert "(compilation cache off)" in off and text(off) == text(first)
  assert acceptance(off) == acceptance(first)
  assert _entries(default_dir) == written

  moved = tmp_path / "moved"
  plain = run(f"--compile_cache_dir={moved}", "--spec_k=0")
  assert _summary(plain)[0] == 0
  assert _entries(moved) and _entries(default_dir) == written
