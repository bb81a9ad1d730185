"""maverick.program_cache: exported programs saved and loaded in place of tracing, keyed so that
another static argument, other input shapes or other source never load a stale program, and
skipped where it has not run (inputs on several devices, cache off), and never in the way of a
run: a corrupt entry, a full disk, a read-only directory or a directory that cannot be made are
each warned about once and the program is traced as usual. Each test turns the cache on for a
temporary directory and off again."""

import errno
import io
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from maverick import program_cache


def _layers(w, x, *, n):
  for _ in range(n):
    x = jnp.tanh(x @ w)
  return x, {"norm": jnp.sqrt((x * x).sum(-1)), "n": jnp.full((), n, jnp.int32)}


layers_jit = jax.jit(_layers, static_argnames=("n",))


def _reference(w, x, n):  # float64 NumPy
  w, x = np.asarray(w, np.float64), np.asarray(x, np.float64)
  for _ in range(n):
    x = np.tanh(x @ w)
  return x, np.sqrt((x * x).sum(-1))


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setattr(program_cache, "_warned", set(), raising=False)  # each test sees its own first warnings
  program_cache.enable(str(tmp_path))
  try:
    yield tmp_path
  finally:
    program_cache.enable(None)


@pytest.fixture
def inputs():
  kw, kx = jax.random.split(jax.random.key(7))
  return (jax.random.normal(kw, (8, 8), jnp.float32) / 3,
          jax.random.normal(kx, (4, 8), jnp.float32))


def _run(w, x, n):
  exe = program_cache.lower(layers_jit, w, x, n=n).compile()
  return exe(w, x)


def _check(out, w, x, n):
  want_x, want_norm = _reference(w, x, n)
  np.testing.assert_allclose(out[0], want_x, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out[1]["norm"], want_norm, rtol=1e-5, atol=1e-6)
  assert int(out[1]["n"]) == n


def _files(d):
  return sorted(p.name for p in d.iterdir() if p.name.endswith(program_cache.SUFFIX))


def test_second_lowering_loads_the_saved_program(cache_dir, inputs):
  w, x = inputs
  _, looked0, hits0 = program_cache.stats()
  _check(_run(w, x, 3), w, x, 3)
  assert _files(cache_dir) and len(_files(cache_dir)) == 1
  assert program_cache.stats()[1:] == (looked0 + 1, hits0)
  out = _run(w, x, 3)  # from disk: the output structure (a dict in a tuple) comes back too
  assert program_cache.stats()[1:] == (looked0 + 2, hits0 + 1)
  _check(out, w, x, 3)
  assert isinstance(out, tuple) and sorted(out[1]) == ["n", "norm"]


def test_static_arguments_shapes_and_source_are_in_the_key(cache_dir, inputs, monkeypatch):
  w, x = inputs
  _check(_run(w, x, 2), w, x, 2)
  _check(_run(w, x, 5), w, x, 5)  # another static argument: another program
  _check(_run(w, x[:3], 2), w, x[:3], 2)  # another shape
  assert len(_files(cache_dir)) == 3
  monkeypatch.setattr(program_cache, "source_fingerprint", lambda: "edited source")
  hits = program_cache.stats()[2]
  _check(_run(w, x, 2), w, x, 2)
  assert program_cache.stats()[2] == hits and len(_files(cache_dir)) == 4


def test_an_unreadable_file_is_traced_again_and_replaced(cache_dir, inputs):
  w, x = inputs
  _run(w, x, 2)
  (path,) = cache_dir.iterdir()
  path.write_bytes(b"not an exported program")
  hits = program_cache.stats()[2]
  _check(_run(w, x, 2), w, x, 2)
  assert program_cache.stats()[2] == hits
  assert path.read_bytes() != b"not an exported program"
  assert not [p for p in cache_dir.iterdir() if ".tmp-" in p.name]  # written, then renamed


def test_inputs_on_several_devices_and_cache_off_trace_as_before(cache_dir, inputs):
  w, x = inputs
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec("data")))
  looked = program_cache.stats()[1]
  lowered = program_cache.lower(layers_jit, w, xs, n=2)
  assert isinstance(lowered, jax.stages.Lowered) and program_cache.stats()[1] == looked
  _check(lowered.compile()(w, xs), w, x, 2)
  program_cache.enable(None)
  assert isinstance(program_cache.lower(layers_jit, w, x, n=2), jax.stages.Lowered)
  assert not _files(cache_dir)


def test_a_call_with_other_arguments_is_refused(cache_dir, inputs):
  w, x = inputs
  exe = program_cache.lower(layers_jit, w, x, n=2).compile()
  with pytest.raises(TypeError, match="another structure"):
    exe(w, {"x": x})


def test_a_program_export_cannot_hold_is_traced_as_usual(cache_dir, inputs, caplog):
  """A host callback has no serialized form: warned once, lowered the usual way, nothing saved."""
  _, x = inputs
  with_callback = jax.jit(lambda x: jax.pure_callback(
      lambda a: np.sin(a), jax.ShapeDtypeStruct(x.shape, x.dtype), x))
  with caplog.at_level("WARNING", logger="maverick.program_cache"):
    lowered = program_cache.lower(with_callback, x)
  assert isinstance(lowered, jax.stages.Lowered)
  assert "could not be exported" in caplog.text
  np.testing.assert_allclose(lowered.compile()(x), np.sin(np.asarray(x)), rtol=1e-6)
  assert not _files(cache_dir)


def _warnings(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.name == "maverick.program_cache"]


def _corrupt_stablehlo(path):
  """Flips bytes inside the saved module's StableHLO: the file still parses, the module does not
  (what `Failed to deserialize StableHLO` came from on every later run)."""
  blob = path.read_bytes()
  module = bytes(jax.export.deserialize(bytearray(blob)).mlir_module_serialized)
  start = blob.index(module)
  bad = bytearray(blob)
  for i in range(start + len(module) // 4, start + len(module) // 2):
    bad[i] ^= 0x5A
  path.write_bytes(bytes(bad))


def test_a_corrupt_program_is_replaced_and_warned_about_once(cache_dir, inputs, caplog):
  w, x = inputs
  _run(w, x, 2)
  (path,) = cache_dir.iterdir()
  _corrupt_stablehlo(path)
  hits = program_cache.stats()[2]
  with caplog.at_level("WARNING"):
    _check(_run(w, x, 2), w, x, 2)  # traced as usual
  (warning,) = _warnings(caplog)
  assert f"cache entry {path} could not be loaded" in warning and "removed" in warning
  assert program_cache.stats()[2] == hits
  caplog.clear()
  with caplog.at_level("WARNING"):
    _check(_run(w, x, 2), w, x, 2)  # the entry saved again loads cleanly
  assert program_cache.stats()[2] == hits + 1 and not _warnings(caplog)


class _FullDisk(io.FileIO):
  """A file on a full disk: half of a write lands, then ENOSPC."""

  def write(self, data):
    super().write(bytes(data[:len(data) // 2]))
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _full_disk_open(path, mode="r", *args, **kwargs):
  return _FullDisk(path, "w") if "w" in mode else open(path, mode, *args, **kwargs)


def _read_only_open(path, mode="r", *args, **kwargs):
  if "w" in mode:
    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
  return open(path, mode, *args, **kwargs)


@pytest.mark.parametrize("opener,error", [(_full_disk_open, "No space left on device"),
                                          (_read_only_open, "Permission denied")])
def test_a_failed_save_warns_once_and_leaves_no_file(cache_dir, inputs, caplog, monkeypatch,
                                                     opener, error):
  """A full disk or a read-only directory: programs still run, one line names the directory and
  the error for all the saves that fail, and no temporary or partial file is left."""
  w, x = inputs
  monkeypatch.setattr(program_cache, "open", opener, raising=False)  # the module's own writes
  with caplog.at_level("WARNING"):
    _check(_run(w, x, 2), w, x, 2)
    _check(_run(w, x, 3), w, x, 3)
  (warning,) = _warnings(caplog)
  assert f"cannot save to the compilation cache {cache_dir}" in warning and error in warning
  assert not list(cache_dir.iterdir())
  monkeypatch.delattr(program_cache, "open")  # space again: the next lowering saves its program
  _check(_run(w, x, 2), w, x, 2)
  assert len(_files(cache_dir)) == 1


def test_a_directory_that_cannot_be_made_leaves_the_cache_off(tmp_path, inputs, caplog,
                                                              monkeypatch):
  monkeypatch.setattr(program_cache, "_warned", set(), raising=False)
  blocker = tmp_path / "cache"
  blocker.write_text("a file where the cache directory should be")
  try:
    with caplog.at_level("WARNING"):
      program_cache.enable(str(blocker))
    assert program_cache.stats()[0] is None
    (warning,) = _warnings(caplog)
    assert f"compilation cache {blocker} cannot be used (FileExistsError" in warning
    w, x = inputs
    lowered = program_cache.lower(layers_jit, w, x, n=2)
    assert isinstance(lowered, jax.stages.Lowered)
    _check(lowered.compile()(w, x), w, x, 2)
  finally:
    program_cache.enable(None)
