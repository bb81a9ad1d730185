"""XLA reference for `gemm`: the same contraction and epilogue in plain jnp (XLA's FP8 dot with the
scales as a separate elementwise epilogue: what the Pallas kernel fuses)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gemm(x, w, x_scale, w_scale, *, out_dtype) -> jax.Array:
  """x [M, K], w [N, K], scales f32 [M] / [N] or None -> [M, N] out_dtype."""
  acc = jnp.dot(x, w.T, preferred_element_type=jnp.float32)
  if x_scale is not None:
    acc = acc * x_scale[:, None]
  if w_scale is not None:
    acc = acc * w_scale[None, :]
  return acc.astype(out_dtype)
