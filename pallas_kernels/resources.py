"""What one CTA of a kernel may use, and the shared vocabulary of the per-op resource planners.

Each op folder has a `plan.py` whose `plan(...)` takes every argument that changes the kernel's
configuration (shapes, dtypes, the architecture, the SM count) and returns a `Plan`: the config the
kernel will run with, its SMEM bytes / TMEM columns / barriers as Mosaic GPU will allocate them,
and, when nothing fits or the kernel does not take the input, why. The op's `pallas_support` and
its kernel call both go through that plan, so "supported" means "lowers".

Limits (per CTA, one CTA per SM):
  SMEM: 227 KiB = 232448 bytes of dynamic shared memory per block (cudaDevAttrMaxSharedMemory-
    PerBlockOptin) on H100/H200 (sm_90) and B200 (sm_100): the CUDA programming guide's table for
    compute capability 9.0 and 10.0, and the number Mosaic GPU checks against when it lowers
    without a device (jax/experimental/mosaic/gpu/core.py, `_launch`).
  TMEM (sm_100 only): 512 columns of 128 lanes x 32 bits (jax/experimental/mosaic/gpu/tcgen05.py,
    TMEM_MAX_COLS).

How Mosaic GPU counts SMEM (checked against its lowering errors in tests/test_kernel_planner.py):
every scratch buffer starts at a 1024-byte boundary (Pallas' SMEM_ALIGNMENT, which the 128-byte
swizzle needs), so each buffer costs its bytes rounded up to 1 KiB; each mbarrier costs 8 bytes;
a kernel that allocates TMEM keeps the allocated address in 4 bytes of SMEM; a kernel with a
row reduction (jnp max/sum over a register array) gets Pallas' cross-warp reduction scratch
(CompilerParams.reduction_scratch_bytes, 2 KiB by default) once.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

MAX_SMEM_BYTES = {"sm90": 227 * 1024, "sm100": 227 * 1024}
MAX_TMEM_COLUMNS = {"sm90": 0, "sm100": 512}
SMEM_ALIGNMENT = 1024
BARRIER_BYTES = 8
TMEM_ADDRESS_BYTES = 4
REDUCTION_SCRATCH_BYTES = 128 * 4 * 4  # jax: pallas/mosaic_gpu/core.py CompilerParams default


def align(x: int, to: int) -> int:
  return -(-x // to) * to


@dataclasses.dataclass
class Usage:
  """A running tally of one CTA's resources, built buffer by buffer as the kernel allocates."""
  smem_bytes: int = 0
  tmem_columns: int = 0
  barriers: int = 0
  items: list = dataclasses.field(default_factory=list)  # (name, bytes) for error messages

  def smem(self, name: str, shape, dtype) -> "Usage":
    nbytes = math.prod(shape) * jnp.dtype(dtype).itemsize
    self.smem_bytes += align(nbytes, SMEM_ALIGNMENT)
    self.items.append((name, nbytes))
    return self

  def barrier(self, count: int = 1) -> "Usage":
    self.barriers += count
    self.smem_bytes += count * BARRIER_BYTES
    return self

  def reduction_scratch(self) -> "Usage":
    self.smem_bytes += align(REDUCTION_SCRATCH_BYTES, SMEM_ALIGNMENT)
    self.items.append(("reduction scratch", REDUCTION_SCRATCH_BYTES))
    return self

  def tmem(self, columns: int) -> "Usage":
    if self.tmem_columns == 0:
      self.smem_bytes += TMEM_ADDRESS_BYTES
    self.tmem_columns += align(columns, 8)
    return self

  def over(self, arch: str) -> str:
    """Why this does not fit one CTA of `arch`, or "" when it does."""
    why = []
    if self.smem_bytes > MAX_SMEM_BYTES[arch]:
      top = ", ".join(f"{name} {nbytes}" for name, nbytes in
                      sorted(self.items, key=lambda item: -item[1])[:3])
      why.append(f"needs {self.smem_bytes} bytes of SMEM > {MAX_SMEM_BYTES[arch]} on {arch} "
                 f"(largest: {top})")
    if self.tmem_columns > MAX_TMEM_COLUMNS[arch]:
      why.append(f"needs {self.tmem_columns} TMEM columns > {MAX_TMEM_COLUMNS[arch]} on {arch}")
    return "; ".join(why)


@dataclasses.dataclass(frozen=True)
class Plan:
  """A planner's answer. `config` is what the kernel runs with (None when unsupported); `why` is
  empty exactly when the kernel takes the input and its config fits the architecture."""
  op: str
  arch: str
  config: Any = None
  smem_bytes: int = 0
  tmem_columns: int = 0
  barriers: int = 0
  why: str = ""

  @property
  def supported(self) -> bool:
    return not self.why

  @classmethod
  def unsupported(cls, op: str, arch: str, why: str, usage: Usage | None = None) -> "Plan":
    usage = usage or Usage()
    return cls(op, arch, None, usage.smem_bytes, usage.tmem_columns, usage.barriers, why)

  @classmethod
  def of(cls, op: str, arch: str, config, usage: Usage) -> "Plan":
    return cls(op, arch, config, usage.smem_bytes, usage.tmem_columns, usage.barriers,
               usage.over(arch))


def plan_arch(arch: str | None) -> str:
  """The architecture to plan for: `arch`, else the one a kernel would run on now, else sm90 (no
  GPU: the answer is only about shapes, the caller runs XLA anyway)."""
  from pallas_kernels import common
  if arch is not None:
    common.check(arch in common.ARCHS, f"arch={arch!r}; choose one of {common.ARCHS}")
    return arch
  return common.runnable_arch() or "sm90"


def plan_num_sms(arch: str) -> int:
  """The SM count the kernels will size their grids by on `arch` (the GPU's, interpret mode's, or
  the part's when lowering without one)."""
  from pallas_kernels import common
  if common.runnable_arch() is not None:
    return common.num_sms()
  return common._NUM_SMS[arch]
