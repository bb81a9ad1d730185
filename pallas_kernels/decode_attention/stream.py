"""What the sm90 (wgmma) and sm100 (tcgen05) decode kernels share: the per-CTA metadata load, the
producer warpgroup's TMA stream of K/V tiles through the SMEM ring, the scaled and masked scores
of one KV tile, and the online-softmax step. The kernels differ only in where S and O live
(registers vs TMEM) and how the MMAs are issued. Visibility rules: see sm90.py's docstring."""

from __future__ import annotations

import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax


def load_metadata(gmem, smem, barrier, *, b, bk, split, rows):
  """One TMA arrival per ref on `barrier`: the query tile, per-row positions / chunk starts,
  the (row, split) bounds, the tree bit words (None when there is no tree) and, on a paged
  cache, the split's physical tile ids (None when contiguous).
  gmem = (q, pos, chunk_start, bounds, bits, tiles), smem likewise."""
  q_g, pos_g, cs_g, bounds_g, bits_g, tiles_g = gmem
  q_s, pos_s, cs_s, bounds_s, bits_s, tiles_s = smem
  if tiles_g is not None:
    plgpu.copy_gmem_to_smem(tiles_g.at[b, split], tiles_s, barrier)
  plgpu.copy_gmem_to_smem(q_g.at[bk, rows], q_s, barrier)
  plgpu.copy_gmem_to_smem(pos_g.at[b, rows], pos_s, barrier)
  plgpu.copy_gmem_to_smem(cs_g.at[b, rows], cs_s, barrier)
  plgpu.copy_gmem_to_smem(bounds_g.at[b, split], bounds_s, barrier)
  if bits_g is not None:
    plgpu.copy_gmem_to_smem(bits_g.at[b, :, rows], bits_s, barrier)


def stream_kv(gmem, smem, ready, free, *, b, kh, first_block, num_steps, block_kv: int,
              stages: int, tiles_s=None):
  """The producer warpgroup: K and V tiles (and their fp8 scales) of KV steps 0..num_steps-1 into
  ring slot step % stages; a slot is refilled once its consumer arrives on its `free` barrier.
  gmem = (k, v, k_scale, v_scale) (scales None for bf16), smem likewise; ready = their barriers;
  free = (k_free, v_free).

  Contiguous cache (tiles_s None): k/v [B, S, K, Dh], scales [B, K, S]; step i reads slots
  (first_block + i) * block_kv onwards of row b. Paged cache: k/v are tile pools
  [num_tiles, block_kv, K, Dh], scales [num_tiles, K, block_kv], and step i reads pool tile
  tiles_s[i // W, i % W] (the split's tile ids [R, W], resolved from the block table by api.py):
  one TMA copy per tile straight from its block, no gather."""
  k_g, v_g, ks_g, vs_g = gmem
  k_s, v_s, ks_s, vs_s = smem
  k_bar, v_bar, ks_bar, vs_bar = ready
  k_free, v_free = free

  def issue(step, slot, cache_g, cache_s, cache_bar, scale_g, scale_s, scale_bar):
    if tiles_s is None:
      kv = pl.ds((first_block + step) * block_kv, block_kv)
      src, scale_src = cache_g.at[b, kv, kh], None if scale_g is None else scale_g.at[b, kh, kv]
    else:
      width = tiles_s.shape[1]
      tile = tiles_s[lax.div(step, jnp.int32(width)), lax.rem(step, jnp.int32(width))]
      src = cache_g.at[tile, pl.ds(0, block_kv), kh]
      scale_src = None if scale_g is None else scale_g.at[tile, kh]
    plgpu.copy_gmem_to_smem(src, cache_s.at[slot], cache_bar.at[slot])
    if scale_g is not None:
      plgpu.copy_gmem_to_smem(scale_src, scale_s.at[slot], scale_bar.at[slot])

  issue_k = lambda step, slot: issue(step, slot, k_g, k_s, k_bar, ks_g, ks_s, ks_bar)
  issue_v = lambda step, slot: issue(step, slot, v_g, v_s, v_bar, vs_g, vs_s, vs_bar)

  for i in range(stages):
    @pl.when(i < num_steps)
    def _(i=i):
      issue_k(jnp.int32(i), i)
      issue_v(jnp.int32(i), i)

  def refill(step, carry):
    slot = lax.rem(step, jnp.int32(stages))
    plgpu.barrier_wait(k_free.at[slot])  # released by the consumer of step - stages
    issue_k(step, slot)
    plgpu.barrier_wait(v_free.at[slot])
    issue_v(step, slot)
    return carry
  lax.fori_loop(jnp.int32(stages), jnp.maximum(num_steps, stages), refill, None)


def masked_scores(s, *, layout, score_scale: float, k_scale_row, first_slot, pos_s, cs_s,
                  bits_s, tree_start, tree_end):
  """Raw Q K^T scores [M, block_kv] (f32, `layout`) of the tile whose first slot is `first_slot`
  -> scaled to log2 units (times the fp8 k scale per slot when `k_scale_row` is given), -inf
  where the slot is invisible to the row."""
  shape = s.shape
  if k_scale_row is not None:
    s = s * lax.broadcast_in_dim(k_scale_row * score_scale, shape, [1])
  else:
    s = s * score_scale
  # Per-row vectors are re-read from SMEM each step rather than held as [M, block_kv]
  # broadcasts across the loop (registers).
  row = lambda ref: lax.broadcast_in_dim(plgpu.load(ref, layout=layout.reduce(1)), shape, [0])
  slot_ids = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=layout) + first_slot
  visible = (slot_ids <= row(pos_s)) & (slot_ids >= row(cs_s)) & (slot_ids < tree_start)
  if bits_s is not None:
    rel = slot_ids - tree_start
    in_tree = (rel >= 0) & (slot_ids < tree_end)
    bit = jnp.zeros(shape, jnp.int32)
    for w in range(bits_s.shape[0]):
      shifted = lax.shift_right_logical(row(bits_s.at[w]), jnp.clip(rel - 32 * w, 0, 31))
      bit = jnp.where((rel >= 32 * w) & (rel < 32 * (w + 1)), shifted & 1, bit)
    visible = visible | (in_tree & (bit != 0))
  return jnp.where(visible, s, -jnp.inf)


def softmax_step(s, m_i, l_i):
  """Online softmax (base 2) over one tile: (p, m_new, alpha, l_new); the caller rescales its
  running output by alpha before adding p @ V."""
  m_new = jnp.maximum(m_i, s.max(axis=1))
  # A row that has seen nothing yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
  m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m_i - m_safe)
  p = jnp.exp2(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
  return p, m_new, alpha, l_i * alpha + p.sum(axis=1)
