"""XLA:GPU flags that keep generate's and spec generate's `lax.while_loop` on the device.

Why. XLA:GPU runs a `while` as a WhileThunk by default: every iteration it launches the condition
computation, copies the predicate to the host (a device-to-host memcpy plus a stream sync) and
decides on the host whether to launch the body again (openxla/xla#6973). A decode step of a large
model is well under a millisecond, so that round trip and the lost launch-ahead are a large share of
it. With command buffers of type WHILE, XLA records the loop as a CUDA graph with a conditional node:
condition and body run from the graph and the predicate never leaves the device. XLA drops WHILE
and CONDITIONAL when the CUDA runtime or driver is older than 12.3.

What this jaxlib has (jax/jaxlib 0.12.0.1, read from its default DebugOptions): command buffers of
types FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN, DYNAMIC_SLICE_FUSION, CONDITIONAL and
COLLECTIVES_KERNEL are on by default; WHILE and COLLECTIVES (NCCL) are not; the smallest captured
region is 5 commands. A `while` becomes one command only when every instruction in its condition
and body is a command too, so:

  --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL,+COLLECTIVES
        WHILE: the loop itself; CONDITIONAL (already a default here, named so older defaults still get
        it): the `lax.cond`s inside the loop; COLLECTIVES: TP/EP all-reduces inside the loop body
        (without it, a sharded loop falls back to the host-driven WhileThunk). "+" adds to XLA's
        default list instead of replacing it.
  --xla_gpu_graph_min_graph_size=1
        capture a region even when it is a lone `while` between other thunks.
  --xla_gpu_enable_cub_radix_sort=false
        XLA rewrites large sorts into CUB radix sorts (CubSortThunk), and that thunk kind has no
        command type in XLA's command_buffer_conversion_pass.cc, so one sort anywhere in the loop
        keeps the whole loop host-driven. Ours: the top-k/top-p filter sorts the vocabulary (inside
        a `lax.cond`, but a branch that does not run still has to be convertible) and the MoE
        routing argsorts. Without CUB, XLA emits its own sort kernels (plain kernel commands);
        they are slower on long rows, which costs only sampled (top-k/top-p) decoding.
  --xla_gpu_enable_dynamic_slice_fusion=false
        XLA turns a slice that feeds a custom call into a kDynamicSliceFusion (the call reads the
        sliced buffer in place), and that thunk is not converted into a command buffer (adding
        +DYNAMIC_SLICE_FUSION or +CUSTOM_CALL to the types does not change it). With the kernels,
        the fused all-reduce + norm call takes a static slice of the Pallas GEMM's row-padded
        output, so generate's decode loop and the speculative loops were host-driven. Off, the
        slice is an ordinary fusion that copies the rows (a decode step's [rows, D] activations).
        Deviceless B200 compile of the Maverick FP8 TP8 shard, 2 layers, kernels: while loops in
        command buffers / host-driven 10 / 1 -> 11 / 0 (generate), 18 / 3 -> 21 / 0 (spec
        generate); the XLA path's programs had no kDynamicSliceFusion to begin with.

Mosaic GPU kernels (our Pallas kernels) are `mosaic_gpu_v2` FFI custom calls whose handlers are
registered with the command-buffer-compatible trait (jax-ml/jax jaxlib/mosaic/gpu/custom_call.cc),
and CUSTOM_CALL is a default type, so they can sit inside the graph (XLA looks the trait up by
platform; openxla/xla#14889 was a platform-name mismatch there, since closed). WHILE has been its own
command type, apart from CONDITIONAL, since openxla/xla#19528 (Nov 2024). Anything that is not a
command (a host callback, a legacy custom call not listed in
legacy_command_buffer_custom_call_targets) keeps the whole loop op-by-op; no GPU has checked ours
yet: `benchmarks/gpu_check.py` counts the device-to-host copies of one generate call in a profile.

Rules (`configure()`):
  * only when the backend will be a CUDA GPU (a jax CUDA plugin is installed and JAX_PLATFORMS, if
    set, allows cuda/gpu) and jax's backends are not initialised yet: XLA reads XLA_FLAGS once, at
    start-up, so a later change would silently do nothing;
  * a flag the user already put in XLA_FLAGS wins: ours is not added for that flag;
  * MAVERICK_GPU_LOOP_FLAGS=0 (or off/false/no) disables all of it;
  * idempotent: a second call adds nothing.

`import maverick` calls `configure()` (it imports nothing heavy and never starts a backend); the
scripts call it first thing. Call it yourself before your first jax operation if you import jax
before maverick.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import sys

ENV_SWITCH = "MAVERICK_GPU_LOOP_FLAGS"
LOOP_FLAGS: tuple[tuple[str, str], ...] = (
    ("xla_gpu_enable_command_buffer", "+WHILE,+CONDITIONAL,+COLLECTIVES"),
    ("xla_gpu_graph_min_graph_size", "1"),
    ("xla_gpu_enable_cub_radix_sort", "false"),
    ("xla_gpu_enable_dynamic_slice_fusion", "false"),
)
_CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12", "jax_cuda13_plugin",
                 "jax_cuda12_plugin")


def flag_names(xla_flags: str) -> set[str]:
  """Names of the flags in an XLA_FLAGS string ('--name=value' or '--name' entries)."""
  names = set()
  for tok in shlex.split(xla_flags or ""):
    if tok.startswith("--"):
      names.add(tok[2:].split("=", 1)[0])
  return names


def merge(xla_flags: str | None, flags=LOOP_FLAGS) -> str:
  """XLA_FLAGS with `flags` appended, skipping any flag name already present (the user's wins)."""
  current = (xla_flags or "").strip()
  present = flag_names(current)
  added = [f"--{name}={value}" for name, value in flags if name not in present]
  return " ".join([current, *added]).strip()


def disabled(environ=os.environ) -> bool:
  return environ.get(ENV_SWITCH, "").strip().lower() in ("0", "off", "false", "no")


def backends_started() -> bool:
  """Whether jax has initialised a backend, asked without initialising one (and without importing
  jax when nobody has)."""
  if "jax" not in sys.modules:
    return False
  try:
    from jax._src import xla_bridge
  except ImportError:  # jax half-imported or very different: assume the worst
    return True
  check = getattr(xla_bridge, "backends_are_initialized", None)
  if check is not None:
    return bool(check())
  return bool(getattr(xla_bridge, "_backends", {}))


def cuda_expected(environ=os.environ) -> bool:
  """Whether jax's default backend will be a CUDA GPU: a CUDA plugin is installed and JAX_PLATFORMS
  (if set) lets it be used. Decided without starting a backend."""
  platforms = environ.get("JAX_PLATFORMS", "").strip().lower()
  if platforms and not ({"cuda", "gpu"} & {p.strip() for p in platforms.split(",")}):
    return False
  for name in _CUDA_PLUGINS:
    try:
      if importlib.util.find_spec(name) is not None:
        return True
    except (ImportError, ValueError):  # parent package missing
      continue
  return False


def configure(environ=os.environ, *, force: bool = False) -> str:
  """Appends the loop flags to XLA_FLAGS when they can still take effect. Returns what happened:
  "set", "disabled", "not-gpu", "backend-started" or "already-set" (nothing left to add).
  `force`: skip the GPU check (for a script that knows it runs on a GPU, and for tests)."""
  if disabled(environ):
    return "disabled"
  if not force and not cuda_expected(environ):
    return "not-gpu"
  before = environ.get("XLA_FLAGS", "")
  after = merge(before)
  if after == before.strip():
    return "already-set"
  if backends_started():
    return "backend-started"
  environ["XLA_FLAGS"] = after
  return "set"


def active_flags(environ=os.environ) -> dict[str, str]:
  """The loop flags as XLA_FLAGS holds them now (the user's value where the user set one)."""
  values = {}
  for tok in shlex.split(environ.get("XLA_FLAGS", "")):
    if tok.startswith("--"):
      name, _, value = tok[2:].partition("=")
      if any(name == n for n, _ in LOOP_FLAGS):
        values[name] = value
  return values
