"""Plain-jnp (XLA) prefill attention with exactly the kernel's semantics (see api.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visibility(T: int, lengths: jax.Array, chunk_size: int | None) -> jax.Array:
  """[B,T(query),T(key)] bool: key s visible to query t iff s <= t, s < len, t < len and, on chunked
  layers, s // chunk == t // chunk (chunks aligned to position 0)."""
  pos = jnp.arange(T, dtype=jnp.int32)
  t, s = pos[:, None], pos[None, :]
  mask = s <= t
  if chunk_size is not None:
    mask = mask & (s // chunk_size == t // chunk_size)
  live = pos[None, :] < lengths[:, None]  # [B,T]
  return mask[None] & live[:, :, None] & live[:, None, :]


def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                      chunk_size: int | None, sm_scale: float) -> jax.Array:
  B, T, H, Dh = q.shape
  K = k.shape[2]
  qg = q.reshape(B, T, K, H // K, Dh)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
  mask = visibility(T, lengths, chunk_size)[:, None, None]  # [B,1,1,T,T]
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # rows with nothing visible
  p = jnp.exp(scores - row_max)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  # Probabilities enter P V as bf16 (as in the kernel and maverick.model.attention); rows with no
  # visible key (padding rows t >= lengths[b]) come out 0.
  p = (p / jnp.where(denom > 0, denom, 1.0)).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", p, v, preferred_element_type=jnp.float32)
  return out.reshape(B, T, H, Dh).astype(q.dtype)
