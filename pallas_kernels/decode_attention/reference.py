"""Plain-jnp (XLA) decode / verify attention over a KV cache: the semantics the kernel matches.

Slot s of the cache holds position s, except for an optional tree block: slots
tree_start[b] .. tree_start[b]+R-1 hold positions tree_positions[b, r], query t sees tree slot r
iff tree_visible[b, t, r] (and the positional mask allows it), and slots after the block are
invisible. A query at position p sees slot positions kv with 0 <= kv <= p, and on chunked layers
only kv // chunk_size == p // chunk_size (chunks aligned to position 0).
Query head j uses kv head j // (H // K). FP8 KV: e4m3 k/v with per-token-per-kv-head scales
[B, S, K]; the k scale multiplies the scores, the v scale the probabilities.
A query that sees no slot gets output 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visibility(q_positions, num_slots: int, chunk_size: int | None, tree_start=None,
               tree_positions=None, tree_visible=None):
  """[B, T, S] bool mask (re-implemented here so pallas_kernels stands alone)."""
  B, T = q_positions.shape
  slots = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32), (B, num_slots))
  kv_pos = slots
  allowed = jnp.ones((B, T, num_slots), bool)
  if tree_positions is not None:
    R = tree_positions.shape[1]
    rel = slots - tree_start[:, None].astype(jnp.int32)
    in_tree = (rel >= 0) & (rel < R)
    rel_c = jnp.clip(rel, 0, R - 1)
    kv_pos = jnp.where(in_tree, jnp.take_along_axis(tree_positions, rel_c, axis=1), slots)
    tree_vis = jnp.take_along_axis(
        tree_visible, jnp.broadcast_to(rel_c[:, None, :], (B, T, num_slots)), axis=2)
    allowed = jnp.where(in_tree[:, None, :], tree_vis, (rel < 0)[:, None, :])
  q = q_positions[:, :, None]
  kv = kv_pos[:, None, :]
  mask = (kv <= q) & (kv >= 0) & allowed
  if chunk_size is not None:
    mask &= (kv // chunk_size) == (q // chunk_size)
  return mask


def decode_attention(q, k_cache, v_cache, q_positions, *, chunk_size=None, k_scale=None,
                     v_scale=None, tree_start=None, tree_positions=None, tree_visible=None,
                     sm_scale=None):
  B, T, H, Dh = q.shape
  S, K = k_cache.shape[1], k_cache.shape[2]
  G = H // K
  sm_scale = Dh ** -0.5 if sm_scale is None else sm_scale
  mask = visibility(q_positions, S, chunk_size, tree_start, tree_positions, tree_visible)
  qg = q.reshape(B, T, K, G, Dh)
  k = k_cache.astype(q.dtype)
  v = v_cache.astype(q.dtype)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
  if k_scale is not None:
    scores = scores * jnp.transpose(k_scale, (0, 2, 1))[:, :, None, None, :]
  scores = jnp.where(mask[:, None, None], scores * sm_scale, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  e = jnp.exp(scores - row_max)
  denom = jnp.sum(e, axis=-1, keepdims=True)
  probs = jnp.where(denom > 0, e / jnp.where(denom > 0, denom, 1.0), 0.0)  # empty rows -> 0
  if v_scale is not None:
    probs = probs * jnp.transpose(v_scale, (0, 2, 1))[:, :, None, None, :]
  out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(B, T, H, Dh).astype(q.dtype)


decode_attention_jit = jax.jit(decode_attention, static_argnames=("chunk_size", "sm_scale"))


def gather_pages(pool, block_table):
  """The contiguous view [B, M * bs, ...] of pool [N, bs, ...] through block_table [B, M]: slot s
  of row b is pool[block_table[b, s // bs], s % bs]. Entries < 0 (no block) read as zeros."""
  B, M = block_table.shape
  rows = jnp.take(pool, jnp.clip(block_table, 0, pool.shape[0] - 1), axis=0)  # [B, M, bs, ...]
  keep = (block_table >= 0).reshape((B, M) + (1,) * (pool.ndim - 1))
  rows = jnp.where(keep, rows, jnp.zeros((), pool.dtype))
  return rows.reshape((B, M * pool.shape[1]) + pool.shape[2:])
