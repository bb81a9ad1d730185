"""Exported-program cache: a later process skips tracing and lowering the generate loops.

JAX's persistent compilation cache (turned on by the CLI scripts, maverick/cli.py) keys a compiled
executable by its lowered module, so every run still traces the loop in Python and lowers it to
StableHLO before it can look the executable up; on the embedded model that is most of a cache-hit
start-up. Here the traced and lowered program is also saved with `jax.export`, under a key made of
everything that decides it: the source of maverick/, spec_decode/ and pallas_kernels/, the jax,
jaxlib and flax versions, JAX's configuration, the function, its static arguments (graphdefs
included: they hold the config and kernel settings) and the input shapes, dtypes and shardings. A
later process with the same key deserializes it and lowers only a call to it; the compilation
cache then has the executable.

Used only where it has run: one CPU device, no mesh. On a GPU, with sharded inputs, or without the
`flatbuffers` package (jax.export's serialization needs it), programs are traced as before. Off
until `enable` is called, which the CLI scripts do next to the compilation cache: a library user's
in-process generate never reads it.

A cache never stops a run: a directory that cannot be made turns it off, a failed write (read-only
directory, full disk) leaves no temporary file behind, and an entry that does not load is deleted
and saved anew; each problem is warned about once per process, in one line (`warn_once`).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
from typing import Any, Callable

import jax

_ROOT = pathlib.Path(__file__).resolve().parents[1]
_PACKAGES = ("maverick", "spec_decode", "pallas_kernels")
SUFFIX = ".exported"

_state: dict[str, Any] = {"dir": None, "requests": 0, "hits": 0}
_warned: set[str] = set()
_FIX = "point --compile_cache_dir at a writable directory, or --compile_cache_dir= for none"


def warn_once(topic: str, message: str) -> None:
  """Logs a cache problem the first time `topic` comes up in this process, as one line."""
  if topic not in _warned:
    _warned.add(topic)
    logging.getLogger(__name__).warning(message.replace("\n", " "))


def describe(error: BaseException) -> str:
  return f"{type(error).__name__}: {error}"


def warn_unwritable(directory: str, error: BaseException) -> None:
  """A write into a cache failed (read-only directory, full disk): said once for all caches."""
  warn_once("unusable", f"cannot save to the compilation cache {directory} ({describe(error)}): "
                        f"programs are compiled but not saved; free space or {_FIX}")


def remove_bad_entry(path: str, error: BaseException) -> None:
  """Deletes a cache entry that failed to load, so this run saves it again (left in place, it
  fails the same way on every later run). The first one is warned about."""
  try:
    os.remove(path)
    done = "removed; it is compiled and saved again (so is any other entry that fails)"
  except FileNotFoundError:
    done = "already removed"
  except OSError as e:
    done = f"it could not be removed ({describe(e)}): delete it by hand"
  warn_once("bad entry", f"cache entry {path} could not be loaded ({describe(error)}): {done}")


def remove_quietly(path: str) -> None:
  """Removes a partial file after a failed write, if it is there (the write's warning names the
  directory)."""
  try:
    os.remove(path)
  except OSError:
    pass


def make_dir(directory: str) -> bool:
  """Makes a cache directory if needed; False, warned once, when it cannot be made (a file of
  that name, a read-only parent)."""
  try:
    os.makedirs(directory, exist_ok=True)
    return True
  except OSError as e:
    warn_once("unusable", f"compilation cache {directory} cannot be used ({describe(e)}): "
                          f"running without it; {_FIX}")
    return False


def enable(directory: str | None) -> None:
  """Saves and loads exported programs under `directory` (None: off; also when it cannot be
  made)."""
  _state["dir"] = directory if directory is not None and make_dir(directory) else None


def stats() -> tuple[str | None, int, int]:
  """(directory or None when off, programs looked up, programs loaded without tracing)."""
  return _state["dir"], _state["requests"], _state["hits"]


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
  """sha256 over every .py file of the packages whose code a traced program is made of."""
  h = hashlib.sha256()
  for package in _PACKAGES:
    for path in sorted((_ROOT / package).rglob("*.py")):
      h.update(str(path.relative_to(_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
  return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _serialization_available() -> bool:
  try:
    import flatbuffers  # noqa: F401,PLC0415  (jax.export's serialization imports it)
  except ImportError:
    return False
  return True


def _usable(arrays) -> bool:
  if _state["dir"] is None or not _serialization_available() or jax.default_backend() != "cpu":
    return False
  devices = {d for x in arrays for d in x.sharding.device_set}
  return len(devices) == 1


def _key(jitted, tree, statics, arrays) -> str:
  import flax  # noqa: PLC0415
  import jaxlib  # noqa: PLC0415
  import numpy  # noqa: PLC0415
  fn = getattr(jitted, "__wrapped__", jitted)
  config = sorted((k, v) for k, v in jax.config.values.items()
                  if "cache" not in k and "log" not in k)
  parts = (f"{fn.__module__}.{fn.__qualname__}", source_fingerprint(), jax.__version__,
           jaxlib.__version__, flax.__version__, numpy.__version__, repr(config),
           jax.devices()[0].device_kind,
           str(tree), repr(statics),
           repr([(x.shape, str(x.dtype), str(x.sharding)) for x in arrays]))
  h = hashlib.sha256()
  for part in parts:
    h.update(part.encode() + b"\0")
  return f"{fn.__name__.strip('_')}-{h.hexdigest()}"


class _FlatLowered:
  """A lowered call of an exported program; compiles to a callable taking the caller's arguments."""

  def __init__(self, lowered, arg_tree):
    self._lowered, self._arg_tree = lowered, arg_tree

  def compile(self):
    return _FlatCompiled(self._lowered.compile(), self._arg_tree)


class _FlatCompiled:
  """Called with the dynamic arguments as the jitted function takes them (pytrees of arrays)."""

  def __init__(self, compiled, arg_tree):
    self._compiled, self._arg_tree = compiled, arg_tree

  def __call__(self, *args):
    leaves, tree = jax.tree.flatten(args)
    if tree != self._arg_tree:
      raise TypeError(f"an exported program was called with arguments of another structure: "
                      f"{tree} (compiled for {self._arg_tree})")
    return self._compiled(*leaves)

  def __getattr__(self, name):  # as_text(), cost_analysis(), ...
    return getattr(self._compiled, name)


def lower(jitted: Callable, *args, **kwargs):
  """`jitted.lower(*args, **kwargs)`, through the exported-program cache where it is usable.

  Array leaves of the arguments are the program's inputs; every other leaf (graphdefs, ints, tree
  shapes) is static. Returns an object whose `compile()` gives a callable of the dynamic arguments,
  as a jax Lowered does."""
  leaves, tree = jax.tree.flatten((args, kwargs))
  is_array = [isinstance(x, jax.Array) for x in leaves]
  arrays = [x for x, a in zip(leaves, is_array) if a]
  if not _usable(arrays):
    return jitted.lower(*args, **kwargs)
  statics = [x for x, a in zip(leaves, is_array) if not a]
  dynamic = tuple(a for a in args if jax.tree.leaves(a) and all(
      isinstance(x, jax.Array) for x in jax.tree.leaves(a)))
  arg_tree = jax.tree.structure(dynamic)
  if arg_tree.num_leaves != len(arrays):  # arrays mixed into static arguments: not handled here
    return jitted.lower(*args, **kwargs)
  path = os.path.join(_state["dir"], _key(jitted, tree, statics, arrays) + SUFFIX)
  name = getattr(jitted, "__wrapped__", jitted).__name__
  _state["requests"] += 1
  lowered = _load(path, name, arrays, arg_tree)
  if lowered is not None:
    _state["hits"] += 1
    return lowered

  def flat(*arrays_in):
    it_a, it_s = iter(arrays_in), iter(statics)
    a, kw = jax.tree.unflatten(tree, [next(it_a) if x else next(it_s) for x in is_array])
    return jitted(*a, **kw)
  try:
    exported = jax.export.export(jax.jit(flat))(*arrays)
    blob = exported.serialize()
  except Exception as e:  # noqa: BLE001  (a program export cannot hold: trace it as usual)
    logging.getLogger(__name__).warning("%s is traced on every run: it could not be exported "
                                        "(%s: %s)", path, type(e).__name__, e)
    return jitted.lower(*args, **kwargs)
  _save(path, blob)
  return _lowered_call(exported, name, arrays, arg_tree)


def _lowered_call(exported, name: str, arrays, arg_tree) -> _FlatLowered:
  def call(*arrays_in):
    return exported.call(*arrays_in)
  call.__name__ = name  # names the compiled module
  return _FlatLowered(jax.jit(call).lower(*arrays), arg_tree)


def _load(path: str, name: str, arrays, arg_tree) -> _FlatLowered | None:
  """The saved program lowered for `arrays`; None when there is none or it does not load (then it
  is deleted: a corrupt entry can parse and still fail later, when its StableHLO is read)."""
  try:
    with open(path, "rb") as f:
      blob = f.read()
  except FileNotFoundError:
    return None
  except OSError as e:  # unreadable: trace, and the save below says what else is wrong
    warn_once("unusable", f"cache entry {path} cannot be read ({describe(e)}): traced instead; "
                          f"{_FIX}")
    return None
  try:
    return _lowered_call(jax.export.deserialize(bytearray(blob)), name, arrays, arg_tree)
  except Exception as e:  # noqa: BLE001  (truncated, corrupted, or from another jax)
    remove_bad_entry(path, e)
    return None


def _save(path: str, blob: bytes) -> None:
  """Writes an entry whole or not at all; a failed write is warned about once, never raised."""
  tmp = f"{path}.tmp-{os.getpid()}"
  try:
    with open(tmp, "wb") as f:
      f.write(blob)
    os.replace(tmp, path)
  except OSError as e:
    warn_unwritable(os.path.dirname(path), e)
  finally:
    remove_quietly(tmp)
