"""The Mosaic GPU kernel: one warpgroup per head row (a packed query row, or one new key / value
of one token and KV head).

A block sums the GEMM's split-K partials of its Dh values, rounds them to bf16 and applies the
layer's RoPE, QK norm and temperature; query blocks write the packed query row (zero past the
T * G real rows: the decode kernel's padding, without a pad launch), key / value blocks write
their cache slot in place (the caches are aliased: `jax.new_ref`), quantized to FP8 where the
cache is. XLA spends three launches on the same: the query's pad fusion and one
dynamic-update-slice fusion per cache, each re-reading the partials.

RoPE rotates interleaved pairs (x[2j], x[2j+1]), which a warpgroup's strided layout puts in
different threads: every head row is read through its [Dh/2, 2] view transposed, so thread t
holds x[2 (t % (Dh/2)) + t // (Dh/2)] (evens in the first half, odds in the second), and the
pair partner comes from a [4, Dh/2] SMEM copy of the row written twice and read one row on.
Stores use the same view, so memory order is unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.qkv_finish import reference

WARPGROUP = 128


def _bf16(x):
  return x.astype(jnp.bfloat16).astype(jnp.float32)


def _pairs(ref):
  """A head row [Dh] of `ref` (viewed [..., Dh/2, 2]) as [2, Dh/2]: evens, then odds."""
  return ref.T


def finish(q_p, k_p, v_p, positions, starts, inv_freq, caches, table, static_scales, *,
           num_heads: int, num_kv_heads: int, batch: int, steps: int, mpad: int,
           layer: reference.Layer):
  """Arrays as api.qkv_finish takes them, with the head rows viewed as pairs: q_p / k_p / v_p
  [S, R, heads, Dh/2, 2], caches [B|N, S|bs, K, Dh/2, 2] (scale caches [B|N, S|bs, K]),
  positions [B*T] and starts [B] int32, inv_freq [2, Dh/2] f32 (both rows the same), table
  [B, M] int32 or None, static_scales [2] f32 or None. Returns q packed [B*K, mpad, Dh/2, 2]
  and the caches written in place."""
  H, K, B, T = num_heads, num_kv_heads, batch, steps
  G = H // K
  S, _, _, half, _ = q_p.shape
  dh = 2 * half
  layout = plgpu.Layout.WG_STRIDED((2, half), vec_size=1)
  dynamic = len(caches) == 4
  paged = table is not None
  n_q, n_kv = B * K * mpad, B * T * K
  refs = [jax.new_ref(c) for c in caches]
  inputs = [q_p, k_p, v_p, positions, starts, inv_freq]
  if paged:
    inputs.append(table)
  if static_scales is not None:
    inputs.append(static_scales)

  def body(*args):
    common.pdl_prologue()
    qp_ref, kp_ref, vp_ref, pos_ref, start_ref, freq_ref = args[:6]
    rest = list(args[6:])
    table_ref = rest.pop(0) if paged else None
    static_ref = rest.pop(0) if static_scales is not None else None
    cache_refs, q_out, scratch = rest[:len(caches)], rest[len(caches)], rest[len(caches) + 1]
    unit = lax.axis_index("units")
    half_idx = lax.broadcasted_iota(jnp.int32, (2, half), 0)

    def summed(p_ref, r, head):
      acc = plgpu.load(_pairs(p_ref.at[0, r, head]), layout=layout).astype(jnp.float32)
      for s in range(1, S):
        acc = acc + plgpu.load(_pairs(p_ref.at[s, r, head]), layout=layout).astype(jnp.float32)
      return _bf16(acc)

    def rotated(x, pos):
      # partner[a, j] = x[1 - a, j]: the row written at SMEM rows 0-1 and 2-3, read at 1-2.
      scratch[0:2] = x
      scratch[2:4] = x
      plgpu.commit_smem()
      partner = plgpu.load(scratch.at[1:3], layout=layout)
      angles = pos.astype(jnp.float32) * plgpu.load(freq_ref, layout=layout)
      sign = (2 * half_idx - 1).astype(jnp.float32)  # evens: x0 cos - x1 sin; odds: + x0 sin
      return _bf16(x * jnp.cos(angles) + sign * partner * jnp.sin(angles))

    def finished_qk(x, pos, is_query):
      if layer.inv_freq is not None:
        x = rotated(x, pos)
      if layer.qk_norm:
        x = _bf16(x * lax.rsqrt(jnp.sum(x * x) / dh + layer.eps))
      if is_query and layer.temperature is not None:
        floor_scale, attn_scale = layer.temperature  # floor_scale integral (api checks)
        steps_ = ((pos + 1) // int(floor_scale)).astype(jnp.float32)
        x = _bf16(x * (jnp.log(1.0 + steps_) * attn_scale + 1.0))
      return x

    bk, m = unit // mpad, unit % mpad

    @pl.when((unit < n_q) & (m < T * G))
    def _query():
      b, kv = bk // K, bk % K
      t, g = m // G, m % G
      r = b * T + t
      x = finished_qk(summed(qp_ref, r, kv * G + g), pos_ref[r], True)
      _pairs(q_out.at[bk, m])[...] = x.astype(q_out.dtype)

    @pl.when((unit < n_q) & (m >= T * G))
    def _padding():  # the decode kernel's pad rows: zero, read nothing
      zeros = plgpu.layout_cast(jnp.zeros((2, half), q_out.dtype), layout)
      _pairs(q_out.at[bk, m])[...] = zeros

    def write(cache, scale_cache, x, r, kv, which):
      b, t = r // T, r % T
      if paged:  # as kv_cache.write_paged: no block (negative) or past the table: dropped
        bs, m_blocks = cache.shape[1], table_ref.shape[1]
        slot = start_ref[b] + t
        j = slot // bs
        block = table_ref[b, jnp.minimum(j, m_blocks - 1)]

        @pl.when((j < m_blocks) & (block >= 0))
        def _():
          store(cache, scale_cache, x, (block, slot % bs, kv), which)
      else:  # as dynamic_update_slice: the row's start clamped to S - T
        slot = jnp.clip(start_ref[b], 0, cache.shape[1] - T) + t
        store(cache, scale_cache, x, (b, slot, kv), which)

    def store(cache, scale_cache, x, where, which):
      dst = _pairs(cache.at[where])
      if dynamic:
        s = jnp.maximum(jnp.max(jnp.abs(x)), reference.MIN_ROW_AMAX) / reference.FP8_MAX
        dst[...] = jnp.clip(x / s, -reference.FP8_MAX, reference.FP8_MAX).astype(cache.dtype)
        scale_cache[where] = s
      elif static_ref is not None:
        q = x / static_ref[which]
        dst[...] = jnp.clip(q, -reference.FP8_MAX, reference.FP8_MAX).astype(cache.dtype)
      else:
        dst[...] = x.astype(cache.dtype)

    @pl.when((unit >= n_q) & (unit < n_q + n_kv))
    def _key():
      u = unit - n_q
      r, kv = u // K, u % K
      x = finished_qk(summed(kp_ref, r, kv), pos_ref[r], False)
      write(cache_refs[0], cache_refs[2] if dynamic else None, x, r, kv, 0)

    @pl.when(unit >= n_q + n_kv)
    def _value():
      u = unit - n_q - n_kv
      r, kv = u // K, u % K
      write(cache_refs[1], cache_refs[3] if dynamic else None, summed(vp_ref, r, kv), r, kv, 1)

  q_type = jax.ShapeDtypeStruct((B * K, mpad, half, 2), jnp.bfloat16)
  q = plgpu.kernel(body, out_type=q_type, grid=(n_q + 2 * n_kv,), grid_names=("units",),
                   scratch_types=[plgpu.SMEM((4, half), jnp.float32)])(*inputs, *refs)
  return q, tuple(r[...] for r in refs)
