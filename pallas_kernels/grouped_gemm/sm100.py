"""Blackwell (sm_100) grouped GEMM: the shared persistent kernel (kernel.py) with tcgen05 MMAs into
TMEM accumulators: 128-row tiles (the tcgen05 M of one CTA), 128-column N tiles, the epilogue read
out of TMEM in 64-column chunks (a full 128x128 f32 tile, twice for swiglu, would not fit in
registers)."""

from __future__ import annotations

import dataclasses

from pallas_kernels.grouped_gemm import kernel


def config(n: int, num_weights: int = 1) -> kernel.Config:
  # SMEM: a stage is 16 KiB of x plus 16 KiB per weight (128x128 bytes of FP8); swiglu's two
  # weights get 3 stages so that stages plus a 64 KiB f32 output tile stay under 227 KiB.
  return kernel.Config(tile_m=128, tile_n=128 if n % 128 == 0 else 64,
                       max_concurrent_steps=4 if num_weights == 1 else 3, epilogue_n=64)


def _config(n, num_weights, w_kn):
  return dataclasses.replace(config(n, num_weights), w_kn=w_kn)


def grouped_matmul(x, w, group_sizes, x_scale, w_scale, out_dtype, w_kn=False, cfg=None,
                   row_groups=None):
  """`cfg`: the planner's (grouped_gemm.plan); default this architecture's tiles."""
  cfg = cfg or _config(w.shape[2 if w_kn else 1], 1, w_kn)
  return kernel.grouped_kernel(x, (w,), group_sizes, x_scale, (w_scale,), out_dtype,
                               lambda acc: acc, cfg, "sm100", row_groups)


def grouped_swiglu(x, w_gate, w_up, group_sizes, x_scale, gate_scale, up_scale, out_dtype,
                   w_kn=False, cfg=None, row_groups=None, row_weights=None):
  """Two accumulators share each x tile; only silu(gate) * up leaves the SM."""
  cfg = cfg or _config(w_gate.shape[2 if w_kn else 1], 2, w_kn)
  return kernel.grouped_kernel(x, (w_gate, w_up), group_sizes, x_scale, (gate_scale, up_scale),
                               out_dtype, kernel.silu_times, cfg, "sm100", row_groups,
                               row_weights)
