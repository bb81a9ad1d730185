"""The on-device self-check behind auto mode: a kernel config runs only after it has proven itself.

No kernel here had run on a GPU when auto mode was made the default, so auto mode must not trust
a config because the planner accepts it: the first time a kernel config is met on a device, it is
compiled and run on a random probe input of the call's exact shapes and compared with the XLA
reference (`Probe.tol`: max |kernel - reference| / max |reference|). A config that fails to
compile, fails at run time, returns non-finite values or disagrees falls back to XLA, with one
`KernelFallbackWarning` per config and process naming the op, the shapes and the reason.

Results are cached in memory and on disk, keyed by (device kind, jax version, a hash of this
package's source and of the file that builds the probe (`maverick/kernels.py`), the CUDA driver,
runtime and ptxas versions, the mesh the call runs on, the kernel config), in
`<cache dir>/kernel_selfcheck.json`: the cache dir is
`$MAVERICK_CACHE_DIR`, else `$XDG_CACHE_HOME/maverick-jax`, else `~/.cache/maverick-jax`. Delete
the file to check again. Run-time errors (an out-of-memory probe, say) are remembered for the
process only, since they may not recur.

The check runs where a kernel would run for real (a Hopper/Blackwell GPU). In GPU interpret mode
(tests) it is off unless `force()` turns it on. The probe runs while the caller's jit is tracing
(the kernel choice is made at trace time): it steps outside that trace (`_outside_any_trace`),
so it is a separate small program run once, never part of the traced computation.

In a multi-process run every process must trace the same program, so a config's outcome is
agreed on: each process's first look at a config (cached or probed) ends with an all-gather of
the outcomes, and the kernel runs only where every process's check passed. Processes trace the
same calls in the same order, so each takes part in every agreement.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import json
import inspect
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Iterator

import jax
import numpy as np
from jax._src import core as jax_core

from pallas_kernels import common

CACHE_FILE = "kernel_selfcheck.json"

_forced: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "pallas_kernels_selfcheck_forced", default=False)
# The mesh a sharded call's per-shard kernel runs on (set by the caller around its shard_map):
# the same local shapes on another mesh are another program, with other collectives around it.
_mesh: contextvars.ContextVar[str] = contextvars.ContextVar("pallas_kernels_selfcheck_mesh",
                                                            default="none")
_memo: dict[str, dict] = {}  # full key -> record, this process
_warned: set[str] = set()
probes_run = 0  # how many probes this process ran (tests read it)


class KernelFallbackWarning(UserWarning):
  """A Pallas kernel config failed its on-device self-check; XLA runs that call instead."""


@dataclasses.dataclass(frozen=True)
class Probe:
  """One kernel config to check. `run(implementation, *args)` calls the op exactly as the model
  does; `make_args(rng)` draws probe inputs of the call's shapes and dtypes (NumPy or jax arrays,
  valid for the op's contract)."""
  op: str
  shapes: str  # what the warning names, e.g. "x bfloat16[200, 5120] @ w float8_e4m3fn[...]"
  key: str  # everything that selects the compiled kernel: shapes, dtypes, layouts, static args
  make_args: Callable[[np.random.Generator], tuple]
  run: Callable[..., jax.Array]
  tol: float


@contextlib.contextmanager
def force(on: bool = True) -> Iterator[None]:
  """Runs the self-check also where it is normally off (GPU interpret mode, for tests)."""
  token = _forced.set(on)
  try:
    yield
  finally:
    _forced.reset(token)


@contextlib.contextmanager
def on_mesh(mesh) -> Iterator[None]:
  """Probes met inside are keyed by `mesh` (its axis names and sizes) too."""
  token = _mesh.set(",".join(f"{name}={size}" for name, size in mesh.shape.items()))
  try:
    yield
  finally:
    _mesh.reset(token)


def active() -> bool:
  """Whether auto mode must self-check kernels now: on a real Hopper/Blackwell GPU, or forced."""
  if _forced.get():
    return True
  return not common.interpreting() and common.gpu_arch() is not None


def cache_path() -> pathlib.Path:
  root = os.environ.get("MAVERICK_CACHE_DIR")
  if not root:
    root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                        "maverick-jax")
  return pathlib.Path(root) / CACHE_FILE


@functools.cache
def _code_hash() -> str:
  """A kernel changed by an upgrade must be checked again: hash this package's source."""
  h = hashlib.sha1()
  root = pathlib.Path(__file__).parent
  for f in sorted(root.rglob("*.py")):
    h.update(f.relative_to(root).as_posix().encode())
    h.update(f.read_bytes())
  return h.hexdigest()[:12]


@functools.cache
def _file_hash(path: str) -> str:
  try:
    return hashlib.sha1(pathlib.Path(path).read_bytes()).hexdigest()[:12]
  except OSError:
    return "unreadable"


def _wrapper_hash(probe: Probe) -> str:
  """The file that defines the probe's `run` (maverick/kernels.py for the model's calls): how a
  call quantizes, reshapes and scales around the kernel is part of what was checked."""
  fn = probe.run.func if isinstance(probe.run, functools.partial) else probe.run
  try:
    return _file_hash(inspect.getsourcefile(fn) or "")
  except TypeError:  # a builtin or C function: nothing to hash
    return "none"


@functools.cache
def toolchain() -> str:
  """CUDA driver and runtime versions and the ptxas release: a driver or toolkit update changes
  what a kernel compiles to, so its configs are checked again. "none" where there is no CUDA."""
  from jax._src import lib as jax_lib
  versions = getattr(jax_lib, "cuda_versions", None)
  parts = []
  for what, name in (("driver", "cuda_driver_get_version"), ("runtime", "cuda_runtime_get_version")):
    try:
      parts.append(f"{what} {getattr(versions, name)()}")
    except Exception:  # noqa: BLE001 - no CUDA plugin, or an older one without the call
      parts.append(f"{what} none")
  parts.append(f"ptxas {_ptxas_version(getattr(jax_lib, 'cuda_path', None))}")
  return " ".join(parts)


def _ptxas_version(cuda_path) -> str:
  candidates = [pathlib.Path(cuda_path) / "bin" / "ptxas"] if cuda_path else []
  which = shutil.which("ptxas")
  candidates += [pathlib.Path(which)] if which else []
  for ptxas in candidates:
    try:
      out = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
      continue
    found = re.search(r"release \S+, (V[\d.]+)", out.stdout)
    if found:
      return found.group(1)
  return "none"


def _full_key(probe: Probe) -> str:
  device = jax.devices()[0]
  arch = common.runnable_arch() or "none"
  return (f"{device.device_kind} | jax {jax.__version__} | code {_code_hash()} | "
          f"wrapper {_wrapper_hash(probe)} | {toolchain()} | mesh {_mesh.get()} | "
          f"processes {jax.process_count()} | {arch} | {probe.op} | {probe.key}")


def _load_disk() -> dict:
  try:
    data = json.loads(cache_path().read_text())
    return data if isinstance(data, dict) else {}
  except (OSError, ValueError):
    return {}  # no cache yet, or a damaged one: check again


def _store_disk(key: str, record: dict) -> None:
  """Read-merge-write through a temp file and a rename, so a concurrent process or a crash never
  leaves a half-written cache (at worst one process's new entry is lost and checked again)."""
  path = cache_path()
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = _load_disk()
    data[key] = record
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{CACHE_FILE}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
      json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
  except OSError as e:  # a read-only home must not stop generation
    warnings.warn(f"maverick: could not write the kernel self-check cache {path}: {e}")


def _first_line(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


@contextlib.contextmanager
def _outside_any_trace() -> Iterator[None]:
  """Runs ops eagerly even while a jit is tracing: the probe is its own program. (Unlike
  `jax.ensure_compile_time_eval`, this does not leak eager evaluation into the traced kernel body,
  where `axis_index` must stay symbolic.) Also outside the caller's shard_map: no axis names
  bound, no manual mesh (a multi-device probe runs its own shard_map over the mesh)."""
  saved = jax_core.trace_ctx.axis_env
  jax_core.trace_ctx.set_axis_env(jax_core.top_axis_env)
  try:
    with (jax_core.set_current_trace(jax_core.eval_trace),
          jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))):
      yield
  finally:
    jax_core.trace_ctx.set_axis_env(saved)


def _check(probe: Probe) -> tuple[dict, bool]:
  """(record, persistent): runs the probe. Not persistent: a run-time error."""
  global probes_run
  probes_run += 1
  with _outside_any_trace():
    args = probe.make_args(np.random.default_rng(0))
    try:
      kernel = jax.jit(functools.partial(probe.run, "pallas")).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - any compile failure means "use XLA"
      return dict(ok=False, reason=f"does not compile ({_first_line(e)})"), True
    try:
      out = np.asarray(jax.block_until_ready(kernel(*args)), np.float64)
    except Exception as e:  # noqa: BLE001
      return dict(ok=False, reason=f"fails at run time ({_first_line(e)})"), False
    ref = np.asarray(jax.jit(functools.partial(probe.run, "xla"))(*args), np.float64)
  if out.shape != ref.shape:
    return dict(ok=False, reason=f"output shape {out.shape} != reference {ref.shape}"), True
  finite = np.isfinite(ref)
  if not np.isfinite(out[finite]).all():
    return dict(ok=False, reason="non-finite outputs where the XLA reference is finite"), True
  scale = max(float(np.abs(ref[finite]).max(initial=0.0)), 1e-30)
  err = float(np.abs(out[finite] - ref[finite]).max(initial=0.0)) / scale
  if not err <= probe.tol:
    return dict(ok=False, reason=f"disagrees with XLA: max relative error {err:.3g} > "
                                 f"{probe.tol:g}", max_rel_error=err), True
  return dict(ok=True, reason="", max_rel_error=err), True


def _all_processes_ok(ok: bool) -> bool:
  from jax.experimental import multihost_utils
  with _outside_any_trace():
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok, np.int32))))


def _agree(record: dict) -> dict:
  """Every process's outcome for one config, combined: the kernel runs only if all passed (the
  same program on every host). This process's own record stays on its disk."""
  all_ok = _all_processes_ok(record["ok"])  # every process takes part, whatever its own outcome
  if all_ok or not record["ok"]:
    return record
  return dict(ok=False, reason="its self-check failed on another process of this run (that "
              "process's warning and cache file say why)")


def passed(probe: Probe) -> bool:
  """Whether the kernel config may run: True where no check is due (see `active`), else the
  (cached) outcome of its probe. A failure warns once per config and process."""
  if not active():
    return True
  key = _full_key(probe)
  record = _memo.get(key)
  if record is None:
    record = _load_disk().get(key)
    if not (isinstance(record, dict) and isinstance(record.get("ok"), bool)):
      record, persistent = _check(probe)
      if persistent:
        _store_disk(key, record)
    if jax.process_count() > 1:
      record = _agree(record)
    _memo[key] = record
  if not record["ok"] and key not in _warned:
    _warned.add(key)
    warnings.warn(
        f"maverick: the Pallas {probe.op} kernel for {probe.shapes} on "
        f"{jax.devices()[0].device_kind} failed its self-check: {record['reason']}. XLA runs "
        f"this call instead (kernels=None). Delete {cache_path()} to check again, or pass "
        f"kernels='xla' to skip the kernels.", KernelFallbackWarning, stacklevel=2)
  return record["ok"]


def clear_memory() -> None:
  """Forgets this process's results and warnings (tests; the disk cache stays)."""
  global probes_run
  _memo.clear()
  _warned.clear()
  probes_run = 0
