"""The grouped GEMM's resource planner: the only place that decides whether the Pallas grouped GEMM
takes a call and with which config (see pallas_kernels/resources.py).

The kernel keeps the whole tile schedule in SMEM (16 bytes a tile, tiles ~ A / tile_m + E), next
to the K pipeline (x tile + one weight tile per accumulator per stage), the output tile and the
scales. The architecture's tiles come first (sm90.config / sm100.config); when they do not fit, the
pipeline gets shallower (down to 2 stages: one MMA stays in flight while the next slot loads);
when even that does not fit (a very large A), the call is unsupported and runs on XLA.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import resources
from pallas_kernels.grouped_gemm import kernel, sm90, sm100
from pallas_kernels.grouped_gemm import schedule as sched_lib

FP8 = jnp.dtype(jnp.float8_e4m3fn)
BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.dtype(jnp.float32)
OP = "grouped_gemm"
_OUT_DTYPES = (BF16, F32)
MIN_STAGES = 2  # delay_release=1 needs one more slot than the MMA in flight


def schedule_shape(num_rows: int, num_groups: int, tile_m: int) -> tuple[int, int]:
  """The packed schedule's SMEM shape (schedule.pack of [4, padded_tiles])."""
  flat = max(4 * sched_lib.padded_tiles(num_rows, num_groups, tile_m), 4)  # A = 0: no kernel
  width = min(sched_lib.PACK_WIDTH, flat)
  return -(-flat // width), width


def usage(cfg: kernel.Config, arch: str, num_rows: int, num_groups: int, k: int, in_dtype,
          out_dtype, num_weights: int, scaled: bool) -> resources.Usage:
  """What kernel.grouped_kernel allocates, buffer by buffer."""
  tile_k = cfg.tile_k or kernel.k_alignment(in_dtype)
  k_steps = k // tile_k
  delay = 1 if k_steps > 1 else 0
  stages = min(max(cfg.max_concurrent_steps, delay + 1), k_steps)  # emit_pipeline clamps
  u = resources.Usage()
  u.smem("tile schedule", schedule_shape(num_rows, num_groups, cfg.tile_m), jnp.int32)
  u.smem("output tile", (cfg.tile_m, cfg.tile_n), out_dtype)
  if scaled:
    u.smem("row scales", (cfg.tile_m,), F32)
    for _ in range(num_weights):
      u.smem("channel scales", (cfg.tile_n,), F32)
  u.barrier(1 + scaled)
  if arch == "sm100":
    u.barrier(2)
    for _ in range(num_weights):
      u.tmem(cfg.tile_n)
  u.smem("x stages", (stages, cfg.tile_m, tile_k), in_dtype)
  for _ in range(num_weights):
    u.smem("w stages", (stages, cfg.tile_n, tile_k), in_dtype)
  u.barrier(stages)
  return u


def plan(num_rows: int, num_groups: int, n: int, k: int, x_dtype, w_dtype, *,
         scaled: bool, num_weights: int = 1, out_dtype=jnp.bfloat16, w_layout: str = "enk",
         arch: str | None = None) -> resources.Plan:
  """x [num_rows, k] against num_groups weights (n, k) (1 weight: grouped_matmul; 2: the fused
  grouped_swiglu); `scaled`: FP8 with row and channel scales."""
  arch = resources.plan_arch(arch)
  no = lambda why: resources.Plan.unsupported(OP, arch, why)
  x_dtype, w_dtype, out_dtype = jnp.dtype(x_dtype), jnp.dtype(w_dtype), jnp.dtype(out_dtype)
  plain = x_dtype == w_dtype == BF16 and not scaled
  fp8 = x_dtype == w_dtype == FP8 and scaled
  if not (plain or fp8):
    return no(f"x {x_dtype}, w {w_dtype}, scales {'set' if scaled else None}: the kernel takes "
              f"bf16 x bf16 without scales, or float8_e4m3fn x float8_e4m3fn with both scales")
  if w_layout == "ekn" and w_dtype == FP8:
    return no("FP8 tensor cores take only K-major weights: store FP8 experts as (E, N, K) and "
              "pass w_layout='enk'")
  if out_dtype not in _OUT_DTYPES:
    return no(f"out_dtype {out_dtype}: the kernel writes bfloat16 or float32")
  if k % kernel.k_alignment(x_dtype):
    return no(f"K={k} must be a multiple of {kernel.k_alignment(x_dtype)} for {x_dtype} "
              f"(128-byte TMA/swizzle rows); pad K with zeros in x and w")
  if n % kernel.n_alignment():
    return no(f"N={n} must be a multiple of {kernel.n_alignment()}; pad the output channels of w")
  base = sm90.config(n) if arch == "sm90" else sm100.config(n, num_weights)
  base = dataclasses.replace(base, w_kn=w_layout == "ekn")
  rows = schedule_shape(num_rows, num_groups, base.tile_m)[0]
  if rows > sched_lib.PACK_WIDTH:  # one TMA box: at most 256 rows
    return no(f"A={num_rows} rows need a {rows}-row packed tile schedule (at most "
              f"{sched_lib.PACK_WIDTH}); split the rows into calls")
  last = None
  for stages in range(base.max_concurrent_steps, MIN_STAGES - 1, -1):
    cfg = dataclasses.replace(base, max_concurrent_steps=stages)
    last = usage(cfg, arch, num_rows, num_groups, k, x_dtype, out_dtype, num_weights, scaled)
    if not last.over(arch):
      return resources.Plan.of(OP, arch, cfg, last)
  return resources.Plan.unsupported(
      OP, arch, f"A={num_rows} rows, E={num_groups}: even {MIN_STAGES} pipeline stages "
      f"{last.over(arch)} (the tile schedule takes "
      f"{4 * 4 * sched_lib.padded_tiles(num_rows, num_groups, base.tile_m)} bytes); split the "
      f"rows into calls", last)
