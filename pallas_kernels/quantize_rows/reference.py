"""The XLA reference: the FP8 activation quantization of maverick.quant (per-row e4m3 with the
row's max |x|, floored at MIN_ROW_AMAX and capped at `ub`, mapped to 448), rows zero-padded."""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0
MIN_ROW_AMAX = 1.0 / 512.0  # = maverick.quant.ops.MIN_ROW_AMAX (tests check they agree)


def quantize_rows(x, rows_out: int, ub: float | None = None):
  """x [M, K] -> (e4m3 [rows_out, K], f32 scales [rows_out]); rows past M are zero rows."""
  xf = jnp.pad(x.astype(jnp.float32), ((0, rows_out - x.shape[0]), (0, 0)))
  amax = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1, keepdims=True), MIN_ROW_AMAX)
  if ub is not None:
    amax = jnp.minimum(amax, ub)
  s = amax / FP8_MAX
  return jnp.clip(xf / s, -FP8_MAX, FP8_MAX).astype(FP8), s[:, 0]


def combine_partials(p, x_scale=None, w_scale=None, m: int | None = None):
  """A GEMM's product from its output `p` [S, R, N] (S split-K partials, or S = 1 and the
  finished product) and the epilogue scales (x_scale [R], w_scale [N], both or neither),
  rounded to bf16 as the GEMM's bf16 output is: [m or R, N] bf16."""
  acc = jnp.sum(p.astype(jnp.float32), axis=0)
  if x_scale is not None:
    acc = acc * x_scale[:, None] * w_scale[None, :]
  acc = acc.astype(jnp.bfloat16)
  return acc if m is None else acc[:m]


def swiglu_quantize_rows(gate, up, x_scale, gate_scale, up_scale, m: int, rows_out: int,
                         ub: float | None = None):
  """The SwiGLU of two GEMM outputs (see `combine_partials`), as the model computes it in bf16
  (silu(g) * u), quantized per row: (e4m3 [rows_out, N], f32 [rows_out])."""
  g = combine_partials(gate, x_scale, gate_scale, m)
  u = combine_partials(up, x_scale, up_scale, m)
  return quantize_rows(jax.nn.silu(g) * u, rows_out, ub)
