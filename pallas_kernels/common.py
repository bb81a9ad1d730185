"""What every kernel folder shares: the `implementation=` switch, the target architecture, GPU
interpret mode for CPU tests, and the error type for bad input.

`implementation`:
  "xla"    the plain-jnp reference (runs anywhere);
  "pallas" the Mosaic GPU kernel: on a Hopper (sm_90) or Blackwell (sm_100) GPU, or on any backend
           inside `pallas_kernels.interpret()` (GPU interpret mode: slow, for tests);
  None     auto: "pallas" where it can run (a Hopper/Blackwell GPU, or inside `interpret()`) and the
           op supports the shapes, "xla" otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import re
from collections.abc import Callable, Iterator

import jax
from jax._src import config as jax_config
from jax.experimental.pallas import mosaic_gpu as plgpu

IMPLEMENTATIONS = ("xla", "pallas")
"""The values of every op's `implementation=` besides None (auto: the kernel where it runs,
else XLA)."""
ARCHS = ("sm90", "sm100")

# Interpret mode has no GPU to ask: the architecture to emulate (and whose kernels to pick).
_forced_arch: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pallas_kernels_forced_arch", default=None)
# Persistent kernels size their grid by the SM count; in interpret mode every simulated SM is a
# host thread, so keep it small.
INTERPRET_NUM_SMS = 2


class KernelInputError(ValueError):
  """An input a kernel cannot take: the message names the argument, what it got and the fix."""


def lowered_once(fn, static_argnames):
  """`fn` (a kernel entry) as a jitted function. Inside an outer jit every call with the same shapes
  and static config then lowers to ONE shared function, so JAX runs the Mosaic GPU lowering once
  per distinct kernel, not once per call site: a 48-layer model has ~860 kernel call sites but ~20
  distinct kernels, and lowering each site took ~0.3 s (see README, "GPU programs compiled
  without a GPU"). Interpret mode is part of jit's cache key, so interpreted and GPU traces never
  mix."""
  return jax.jit(fn, static_argnames=static_argnames)


_FUNC = re.compile(r"func\.func (?:public |private )?@([\w.$-]+)\(")
_CALL = re.compile(r"\bcall @([\w.$-]+)\(")
_MOSAIC_CALL = re.compile(r"custom_call @mosaic_gpu\w*\(")


def _call_graph(stablehlo: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
  """Per function of lowered StableHLO text: its Mosaic GPU custom-call lines, and the functions
  it calls (once per call)."""
  kernels, calls, fn = {}, {}, None
  for line in stablehlo.splitlines():
    m = _FUNC.search(line)
    if m:
      fn = m.group(1)
      kernels[fn], calls[fn] = [], []
    elif fn is not None:
      if _MOSAIC_CALL.search(line):
        kernels[fn].append(line)
      calls[fn] += _CALL.findall(line)
  return kernels, calls


def mosaic_call_lines(stablehlo: str, entry: str = "main") -> list[str]:
  """The Mosaic GPU custom-call lines of lowered StableHLO text, each repeated as often as one run
  of `entry` makes that call: a kernel inside a shared function (`lowered_once`) is written once
  in the text but runs at every call site of that function."""
  kernels, calls = _call_graph(stablehlo)
  callers = {}
  for fn, callees in calls.items():
    for callee in callees:
      callers.setdefault(callee, []).append(fn)

  @functools.cache
  def runs(name):
    return 1 if name == entry else sum(runs(c) for c in callers.get(name, ()))

  return [line for name, lines in kernels.items() for line in lines for _ in range(runs(name))]


def mosaic_call_sites(stablehlo: str, entry: str = "main") -> int:
  """How many Mosaic GPU kernel calls one run of `entry` makes (see `mosaic_call_lines`)."""
  return len(mosaic_call_lines(stablehlo, entry))


def kernel_functions(stablehlo: str) -> set[str]:
  """The functions of lowered StableHLO text that call a Mosaic GPU kernel, directly or not."""
  kernels, calls = _call_graph(stablehlo)

  @functools.cache
  def has(name):
    return bool(kernels.get(name)) or any(has(c) for c in calls.get(name, ()))

  return {name for name in kernels if has(name)}


def check(ok: bool, message: str) -> None:
  if not ok:
    raise KernelInputError(message)


def gpu_arch() -> str | None:
  """"sm90" / "sm100" for the default device when it is a Hopper / Blackwell GPU, else None."""
  device = jax.devices()[0]
  cc = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or not cc or cc.startswith("gfx"):
    return None
  major = int(cc.split(".")[0])
  if major == 9:
    return "sm90"
  if major == 10:
    return "sm100"
  return None


def interpreting() -> bool:
  """True inside `interpret()` (or any Pallas GPU interpret-mode context)."""
  return isinstance(jax_config.pallas_tpu_interpret_mode_context_manager.value,
                    plgpu.InterpretGPUParams)


def pdl_supported() -> bool:
  """Whether kernels lowered here take part in programmatic dependent launch: jax 0.12 has the
  griddepcontrol primitives (0.11.2 does not); GPU interpret mode cannot run them."""
  return hasattr(plgpu, "griddepcontrol_wait") and not interpreting()


def pdl_prologue() -> None:
  """A decode-path kernel's first statement (PDL, programmatic dependent launch): wait until the
  kernel before it has finished and its writes are visible (a no-op when this one was not
  launched as a dependent), then let the kernel after it launch now, so its launch and prologue
  overlap this kernel instead of following it (it waits in its own prologue). Nothing is read
  before the wait, so the order of the memory traffic is what it was without PDL. With it the
  module is marked `mosaic_gpu.uses_pdl` and launched as a dependent."""
  if pdl_supported():
    plgpu.griddepcontrol_wait()
    plgpu.griddepcontrol_launch_dependents()


def target_arch() -> str:
  """The architecture whose kernel runs: the GPU's, or the one `interpret(arch=...)` emulates."""
  forced = _forced_arch.get()
  if interpreting():
    return forced or "sm90"
  if forced:  # lower_for_gpu
    return forced
  arch = gpu_arch()
  if arch is None:
    raise KernelInputError(
        f"implementation='pallas' needs a Hopper (sm_90) or Blackwell (sm_100) GPU; this backend "
        f"is {jax.devices()[0].platform!r} ({jax.devices()[0].device_kind}). Use "
        f"implementation='xla', or run inside pallas_kernels.interpret() (GPU interpret mode, slow).")
  return arch


def runnable_arch() -> str | None:
  """The architecture a Pallas kernel would run on now, or None when there is none (CPU/other GPU
  outside interpret mode)."""
  if interpreting() or _forced_arch.get():
    return target_arch()
  return gpu_arch()


# SM counts of the parts we target, for lowering without the GPU (H100/H200: 132, B200: 148).
_NUM_SMS = {"sm90": 132, "sm100": 148}


def num_sms() -> int:
  if interpreting():
    return INTERPRET_NUM_SMS
  if gpu_arch() is not None:
    return jax.devices()[0].core_count
  return _NUM_SMS[target_arch()]


def resolve(implementation: str | None, *, supported: bool = True, why: str = "") -> str:
  """"xla" or "pallas" for an op call. `supported`: whether the Pallas kernel takes these
  shapes/dtypes (auto falls back to XLA when not; an explicit "pallas" raises with `why`)."""
  if implementation not in (None, *IMPLEMENTATIONS):
    raise KernelInputError(
        f"implementation={implementation!r}; choose one of {IMPLEMENTATIONS} or None (auto)")
  if implementation == "xla":
    return "xla"
  if implementation == "pallas":
    target_arch()  # raises with the fix when there is nothing to run the kernel on
    check(supported, f"the Pallas kernel does not support this input: {why}. Use "
          f"implementation='xla' (or None to fall back automatically).")
    return "pallas"
  return "pallas" if runnable_arch() is not None and supported else "xla"


@contextlib.contextmanager
def interpret(arch: str = "sm90", *, detect_races: bool = True) -> Iterator[None]:
  """Runs Pallas kernels called (traced) inside in GPU interpret mode on the host, emulating `arch`.

  Race detection is on by default (tests want it); a race raises. Blackwell's tcgen05 path needs inline MGPU
  ops ignored by the interpreter. Pass arrays traced inside; jit caches do not key on this context,
  so call un-jitted functions or jit them inside the context."""
  check(arch in ARCHS, f"interpret(arch={arch!r}); choose one of {ARCHS}")
  params = plgpu.InterpretGPUParams(
      detect_races=detect_races, inline_mgpu="ignore" if arch == "sm100" else "error")
  token = _forced_arch.set(arch)
  try:
    with plgpu.force_gpu_interpret_mode(params):
      yield
  finally:
    _forced_arch.reset(token)


def lower_for_gpu(fn, *args, arch: str = "sm90") -> str:
  """Lowers `fn(*args)` (ShapeDtypeStructs are fine) for CUDA on any host and returns the StableHLO
  text. Pallas runs Mosaic GPU layout inference and dialect lowering here, so unsupported layouts,
  non-K-major FP8 wgmma operands and the like fail on CPU, before a GPU ever sees the kernel."""
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  check(arch in ARCHS, f"arch={arch!r}; choose one of {ARCHS}")
  cc = {"sm90": (9, 0), "sm100": (10, 0)}[arch]
  saved = mgpu_utils._infer_arch
  mgpu_utils._infer_arch = lambda: cc
  token = _forced_arch.set(arch)
  try:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  finally:
    mgpu_utils._infer_arch = saved
    _forced_arch.reset(token)


@dataclasses.dataclass
class BenchCase:
  """One benchmark entry for `benchmarks/kernels.py`, provided by each op's `bench.py` as
  `benchmark_cases(toy: bool) -> list[BenchCase]` (toy: tiny shapes for `--interpret` on CPU;
  otherwise Maverick shapes). All callables take `*args` and are jitted by the runner."""
  op: str  # "fp8_gemm", "grouped_gemm", "prefill_attention", "decode_attention"
  name: str  # the shape/regime, e.g. "decode M=16 N=5120 K=5120"
  args: tuple  # device arrays, random from a fixed seed
  kernel: Callable  # the Pallas kernel (implementation="pallas")
  reference: Callable  # the XLA reference: correctness is checked against it
  baselines: dict[str, Callable]  # what the issue says to beat, e.g. {"ragged_dot": ...}
  flops: float  # useful FLOPs of one call
  bytes: float  # minimum HBM bytes one call must move
  max_rel_error: float  # allowed max |kernel - reference| / max |reference|
  goal: str = ""  # e.g. ">= 80% of HBM bandwidth" or ">= 1.0x ragged_dot"
