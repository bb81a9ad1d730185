"""The XLA reference: the FP8 activation quantization of maverick.quant (per-row e4m3 with the
row's max |x|, floored at MIN_ROW_AMAX and capped at `ub`, mapped to 448), rows zero-padded."""

from __future__ import annotations

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
