"""Hopper (sm_90) grouped GEMM: the shared persistent kernel (kernel.py) with wgmma and register
accumulators: one warpgroup, 64-row tiles (wgmma M), 128-column N tiles."""

from __future__ import annotations

import dataclasses

from pallas_kernels.grouped_gemm import kernel


def config(n: int) -> kernel.Config:
  return kernel.Config(tile_m=64, tile_n=128 if n % 128 == 0 else 64, max_concurrent_steps=4)


def _config(n, num_weights, w_kn):
  return dataclasses.replace(config(n), w_kn=w_kn)


def grouped_matmul(x, w, group_sizes, x_scale, w_scale, out_dtype, w_kn=False, cfg=None,
                   row_groups=None):
  """`cfg`: the planner's (grouped_gemm.plan); default this architecture's tiles."""
  cfg = cfg or _config(w.shape[2 if w_kn else 1], 1, w_kn)
  return kernel.grouped_kernel(x, (w,), group_sizes, x_scale, (w_scale,), out_dtype,
                               lambda acc: acc, cfg, "sm90", row_groups)


def grouped_swiglu(x, w_gate, w_up, group_sizes, x_scale, gate_scale, up_scale, out_dtype,
                   w_kn=False, cfg=None, row_groups=None, row_weights=None):
  """Two accumulators share each x tile; only silu(gate) * up leaves the SM."""
  cfg = cfg or _config(w_gate.shape[2 if w_kn else 1], 2, w_kn)
  return kernel.grouped_kernel(x, (w_gate, w_up), group_sizes, x_scale, (gate_scale, up_scale),
                               out_dtype, kernel.silu_times, cfg, "sm90", row_groups,
                               row_weights)
