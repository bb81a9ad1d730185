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

import numpy as np
import pytest

from param_utils import single_device_env

REPO = pathlib.Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"(\d+) of (\d+) programs loaded from the compilation cache")

# A process that turns the cache on the way the scripts do, then compiles two programs (one
# through the exported-program cache). argv[2] "full" or "read-only" makes every write under the
# cache directory fail as on a full disk (half the bytes land, then ENOSPC) or a read-only one.
_SNIPPET = """
import builtins, errno, io, os, sys
cache, fault = sys.argv[1], (sys.argv[2:] or [""])[0]

class FullDisk(io.FileIO):
  def write(self, data):
    super().write(bytes(data[:len(data) // 2]))
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

real_open = io.open
def faulty_open(path, mode="r", *args, **kwargs):
  if "w" in mode and str(path).startswith(cache):
    if fault == "full":
      return FullDisk(path, "w")
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
  return real_open(path, mode, *args, **kwargs)
if fault:
  builtins.open = io.open = faulty_open

from maverick import cli, program_cache
cli.enable_compile_cache(cache)
import jax, jax.numpy as jnp
x = jnp.arange(12.0).reshape(3, 4)
f = jax.jit(lambda a: jnp.tanh(a) @ a.T)
print(program_cache.lower(f, x).compile()(x).sum(), jax.jit(lambda a: a.max(0))(x).sum())
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


def _snippet(tmp_path, cache, fault=""):
  return subprocess.run([sys.executable, "-c", _SNIPPET, str(cache), fault], cwd=REPO,
                        env=_env(tmp_path), capture_output=True, text=True, timeout=120)


def _results(stdout: str) -> list[float]:
  """The snippet's two results, against float64 NumPy."""
  x = np.arange(12.0).reshape(3, 4)
  got = [float(v) for v in stdout.splitlines()[0].split()]
  np.testing.assert_allclose(got, [(np.tanh(x) @ x.T).sum(), x.max(0).sum()], rtol=1e-6)
  return got


def test_second_process_loads_every_program_from_the_cache(tmp_path):
  run = lambda: _snippet(tmp_path, tmp_path / "cc")
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


def test_a_corrupt_entry_is_removed_so_the_next_run_loads_cleanly(tmp_path):
  """JAX warns about an entry it cannot load and compiles anew, but never replaced the entry: every
  later run warned and compiled again. Now the run that meets it removes it (one line) and saves
  it again, and the run after that loads everything without a word."""
  cache = tmp_path / "cc"
  first = _snippet(tmp_path, cache)
  assert first.returncode == 0, first.stderr
  compiled = _summary(first.stdout)[1]
  names = sorted(_entries(cache))
  truncated, flipped = cache / names[0], cache / names[-1]
  truncated.write_bytes(truncated.read_bytes()[:40])  # a half-written entry
  blob = bytearray(flipped.read_bytes())
  blob[len(blob) // 3:len(blob) // 2] = bytes(b ^ 0x5A for b in blob[len(blob) // 3:len(blob) // 2])
  flipped.write_bytes(bytes(blob))

  second = _snippet(tmp_path, cache)
  assert second.returncode == 0, second.stderr
  _results(second.stdout)
  lines = second.stderr.splitlines()
  assert len(lines) == 1 and "could not be loaded" in lines[0] and "removed" in lines[0], lines
  assert str(truncated) in lines[0] or str(flipped) in lines[0]
  assert _summary(second.stdout) == (compiled - 2, compiled)

  third = _snippet(tmp_path, cache)
  assert third.returncode == 0 and third.stderr == "", third.stderr
  assert _summary(third.stdout) == (compiled, compiled)
  assert sorted(_entries(cache)) == names


@pytest.mark.parametrize("fault,error", [("file", "FileExistsError"),
                                         ("full", "No space left on device"),
                                         ("read-only", "Permission denied")])
def test_a_cache_that_cannot_be_written_never_stops_a_run(tmp_path, fault, error):
  """A cache directory that is a file, a full disk, a read-only directory: the run computes the
  same results, one line on stderr names the directory and the error, and no partial entry or
  temporary file is left to fail a later run."""
  cache = tmp_path / "cc"
  if fault == "file":
    cache.write_text("a file where the cache directory should be")
  r = _snippet(tmp_path, cache, "" if fault == "file" else fault)
  assert r.returncode == 0, r.stderr
  _results(r.stdout)
  lines = r.stderr.splitlines()
  assert len(lines) == 1 and str(cache) in lines[0] and error in lines[0], r.stderr
  if fault == "file":
    assert "compilation cache off" in r.stdout
    return
  assert not [p for p in cache.rglob("*") if p.is_file()]  # no partial entry, no .tmp file
  again = _snippet(tmp_path, cache)  # room again: saved now, nothing half-written to warn about
  assert again.returncode == 0 and again.stderr == "", again.stderr
  assert _summary(again.stdout)[0] == 0 and _entries(cache)


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
