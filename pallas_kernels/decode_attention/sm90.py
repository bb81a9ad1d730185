"""Hopper (sm_90) split-K decode / verify attention over a KV cache (flash-decoding).

One CTA per (query tile, split, batch row x kv head). The query tile packs the G = H // K query
heads of every new token of one (row, kv head) into the wgmma M dimension (row m = t * G + g,
padded to 64), so one K/V tile read from HBM serves all of them. Each CTA walks its share of the
row's visible KV blocks (bounds computed per row outside the kernel and read from SMEM, so rows
with short contexts or chunked layers skip the blocks they cannot see), streaming K/V tiles by
TMA into swizzled SMEM through a `stages`-deep ring of barriers; scores and P@V use wgmma, the
softmax runs online in f32 (base 2). Warp specialised: one producer warpgroup issues the TMA
copies and refills a slot when its consumer releases it; 2 consumer warpgroups take alternate KV
steps (one's softmax overlaps the other's wgmma). Every consumer of every split writes a
normalised bf16 partial output and its log2-sum-exp; `api.combine` merges them in XLA (a few MB
at Maverick shapes, ~1-3% of the cache bytes).

Visibility inside the kernel, per score (row m, slot s), from per-row vectors prepared by api.py:
  s < tree_start:               chunk_start[m] <= s <= q_pos[m]   (slot s holds position s)
  tree_start <= s < tree_end:   bit (s - tree_start) of tree_bits[:, m]  (positional mask folded in)
  s >= tree_end:                invisible.
Without a tree, tree_start = tree_end = S.

FP8 KV (e4m3): each K/V tile is converted to bf16 in SMEM (the wgmma operands must share a
dtype; q stays bf16 as in the XLA reference), the k scale multiplies the scores and the v scale
the probabilities, per slot.
"""

from __future__ import annotations

import math

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import common
from pallas_kernels.decode_attention import stream

BLOCK_M = 64  # one warpgroup's wgmma M
LOG2E = math.log2(math.e)
# Bounds vector per (row, split): first KV block, number of KV blocks, tree start, tree end. Four
# int32 = 16 bytes, the smallest TMA copy.
NUM_BOUNDS = 4


def _transforms(minor: int, dtype) -> tuple:
  swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _fp8_to_bf16(x):
  # sm_90 converts e4m3 to f16/f32 only; every e4m3 value is exact in f32 and in bf16.
  return x.astype(jnp.float32).astype(jnp.bfloat16)


def smem_plan(Dh: int, block_kv: int, kv_itemsize: int, compute_wgs: int) -> int:
  """Pipeline depth that keeps one CTA's SMEM under ~200 KiB (one CTA per SM), a multiple of
  compute_wgs."""
  per_stage = 2 * block_kv * Dh * kv_itemsize + (2 * block_kv * 4 if kv_itemsize == 1 else 0)
  fixed = BLOCK_M * Dh * 2 + compute_wgs * (BLOCK_M * Dh * 2 + BLOCK_M * block_kv * 2)
  if kv_itemsize == 1:
    fixed += compute_wgs * block_kv * Dh * 2
  stages = min(4, (200 * 1024 - fixed) // per_stage)
  # Each slot must belong to one compute warpgroup (step i uses slot i % stages and warpgroup
  # i % compute_wgs): a warpgroup waiting on a slot's barrier must see every phase of it.
  return max(compute_wgs, stages - stages % compute_wgs)


def split_attention(q_packed, k_cache, v_cache, k_scale, v_scale, q_pos, chunk_start, tree_bits,
                    bounds, *, num_kv_heads: int, num_splits: int, block_kv: int,
                    sm_scale: float, compute_wgs: int, stages: int | None = None,
                    tile_table=None):
  """q_packed [B*K, Mpad, Dh] bf16; k/v_cache [B, S, K, Dh]; k/v_scale [B, K, S] f32 or None;
  q_pos / chunk_start [B, Mpad] int32; tree_bits [B, W, Mpad] int32 or None;
  bounds [B, num_splits, 4] int32. Paged cache (tile_table [B, num_splits, R, W] int32, the
  pool tile each KV step of a split reads, see stream.stream_kv): k/v_cache are tile pools
  [num_tiles, block_kv, K, Dh] and k/v_scale [num_tiles, K, block_kv].
  Returns (out [P, B*K, Mpad, Dh] bf16 normalised per partial,
  lse [P, B*K, Mpad] f32 in log2 units, -inf where a partial saw nothing), P = num_splits *
  compute_wgs: each compute warpgroup keeps its own partial (the XLA combine merges them too).

  Warp specialised: warpgroup `compute_wgs` is the producer (TMA only, few registers); compute
  warpgroup w takes KV steps w, w + compute_wgs, ..., so one's softmax overlaps the other's wgmma
  and TMA refills a slot as soon as its consumer releases it."""
  BK, Mpad, Dh = q_packed.shape
  K = num_kv_heads
  paged = tile_table is not None
  num_m = Mpad // BLOCK_M
  fp8 = k_scale is not None
  has_tree = tree_bits is not None
  num_words = tree_bits.shape[1] if has_tree else 0
  kv_dtype = k_cache.dtype
  score_scale = sm_scale * LOG2E
  C = compute_wgs
  if stages is None:  # the planner's (decode_attention.plan) when called through the api
    stages = smem_plan(Dh, block_kv, jnp.dtype(kv_dtype).itemsize, C)

  q_tr = _transforms(Dh, q_packed.dtype)
  kv_tr = _transforms(Dh, kv_dtype)
  layout = plgpu.Layout.WGMMA
  shape = (BLOCK_M, block_kv)

  def body(*refs):
    common.pdl_prologue()
    if fp8:
      q_g, k_g, v_g, ks_g, vs_g, pos_g, cs_g, *rest = refs
    else:
      q_g, k_g, v_g, pos_g, cs_g, *rest = refs
      ks_g = vs_g = None
    bits_g = rest.pop(0) if has_tree else None
    tiles_g = rest.pop(0) if paged else None
    bounds_g, o_g, lse_g = rest
    mt = lax.axis_index("m")
    split = lax.axis_index("split")
    bk = lax.axis_index("bk")
    wg = lax.axis_index("wg")
    b = lax.div(bk, jnp.int32(K))
    kh = lax.rem(bk, jnp.int32(K))
    rows = pl.ds(mt * BLOCK_M, BLOCK_M)

    def scoped(q_s, k_s, v_s, kvb_s, ks_s, vs_s, pos_s, cs_s, bits_s, tiles_s, bounds_s, o_s, lse_s,
               p_s, meta_bar, k_bar, v_bar, ks_bar, vs_bar, k_free, v_free):
      @pl.when(wg == C)
      def _():
        stream.load_metadata((q_g, pos_g, cs_g, bounds_g, bits_g, tiles_g),
                             (q_s, pos_s, cs_s, bounds_s, bits_s, tiles_s), meta_bar, b=b, bk=bk,
                             split=split, rows=rows)
      plgpu.barrier_wait(meta_bar)
      first_block = bounds_s[0]
      num_steps = bounds_s[1]

      @pl.when(wg == C)
      def _producer():
        plgpu.set_max_registers(40, action="decrease")
        stream.stream_kv((k_g, v_g, ks_g, vs_g), (k_s, v_s, ks_s, vs_s),
                         (k_bar, v_bar, ks_bar, vs_bar), (k_free, v_free), b=b, kh=kh,
                         first_block=first_block, num_steps=num_steps, block_kv=block_kv,
                         stages=stages, tiles_s=tiles_s)

      @pl.when(wg < C)
      def _consumer():
        plgpu.set_max_registers(232, action="increase")
        tree_start = bounds_s[2]
        tree_end = bounds_s[3]
        my_kvb = kvb_s.at[wg] if fp8 else None
        my_p = p_s.at[wg]

        def kv_step(j, carry):
          acc, m_i, l_i = carry
          step = wg + j * C
          slot = lax.rem(step, jnp.int32(stages))
          plgpu.barrier_wait(k_bar.at[slot])
          if fp8:
            my_kvb[...] = _fp8_to_bf16(k_s[slot])
            plgpu.commit_smem()
            k_op = my_kvb
          else:
            k_op = k_s.at[slot]

          def qk_scope(acc_ref):
            plgpu.wgmma(acc_ref, q_s, k_op.T)
            return acc_ref[...]
          s = pl.run_scoped(qk_scope, plgpu.ACC(shape, jnp.float32))
          k_scale_row = None
          if fp8:
            plgpu.barrier_wait(ks_bar.at[slot])
            k_scale_row = plgpu.load(ks_s.at[slot], layout=layout.reduce(0))
          s = stream.masked_scores(
              s, layout=layout, score_scale=score_scale, k_scale_row=k_scale_row,
              first_slot=(first_block + step) * block_kv, pos_s=pos_s, cs_s=cs_s, bits_s=bits_s,
              tree_start=tree_start, tree_end=tree_end)
          p, m_new, alpha, l_i = stream.softmax_step(s, m_i, l_i)
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          plgpu.barrier_wait(v_bar.at[slot])
          if fp8:
            plgpu.barrier_wait(vs_bar.at[slot])
            v_scale_row = plgpu.load(vs_s.at[slot], layout=layout.reduce(0))
            p = p * lax.broadcast_in_dim(v_scale_row, shape, [1])
            my_kvb[...] = _fp8_to_bf16(v_s[slot])  # K's wgmma is done with the buffer
            v_op = my_kvb
          else:
            v_op = v_s.at[slot]
          # P goes through SMEM (8 KiB a step, free next to the HBM stream): the interpreter's
          # wgmma takes SMEM operands only.
          my_p[...] = p.astype(jnp.bfloat16)
          plgpu.commit_smem()

          # A fresh accumulator scope (GPU interpret mode has no run_state): reading it back
          # waits for the wgmma, so the slot can be released afterwards.
          def pv_scope(pv_ref):
            plgpu.wgmma(pv_ref, my_p, v_op)
            return pv_ref[...]
          acc = acc + pl.run_scoped(pv_scope, plgpu.ACC((BLOCK_M, Dh), jnp.float32))
          # K's slot is released only now, after the P store that depends on the k scale load:
          # the interpreter orders SMEM loads by data only, so an earlier arrive could overtake
          # the load (on the GPU either place is fine; the slot is back a step's softmax later).
          plgpu.barrier_arrive(k_free.at[slot])
          plgpu.barrier_arrive(v_free.at[slot])
          return acc, m_new, l_i

        acc = plgpu.layout_cast(jnp.zeros((BLOCK_M, Dh), jnp.float32), layout)
        m_i = plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), layout.reduce(1))
        l_i = plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), layout.reduce(1))
        my_steps = lax.div(jnp.maximum(num_steps - wg + (C - 1), 0), jnp.int32(C))
        acc, m_i, l_i = lax.fori_loop(0, my_steps, kv_step, (acc, m_i, l_i))

        seen = l_i > 0
        inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l_i, 1.0), 0.0)
        o_s[wg] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(o_s.dtype)
        lse_s[wg] = jnp.where(seen, m_i + jnp.log2(jnp.where(seen, l_i, 1.0)), -jnp.inf)
        plgpu.commit_smem()
        part = split * C + wg
        plgpu.copy_smem_to_gmem(o_s.at[wg], o_g.at[part, bk, rows])
        plgpu.copy_smem_to_gmem(lse_s.at[wg], lse_g.at[part, bk, rows])
        plgpu.wait_smem_to_gmem(0)

    f32 = jnp.float32
    pl.run_scoped(
        scoped,
        plgpu.SMEM((BLOCK_M, Dh), q_packed.dtype, transforms=q_tr),
        plgpu.SMEM((stages, block_kv, Dh), kv_dtype, transforms=kv_tr),
        plgpu.SMEM((stages, block_kv, Dh), kv_dtype, transforms=kv_tr),
        plgpu.SMEM((C, block_kv, Dh), jnp.bfloat16, transforms=q_tr) if fp8 else None,
        plgpu.SMEM((stages, block_kv), f32) if fp8 else None,
        plgpu.SMEM((stages, block_kv), f32) if fp8 else None,
        plgpu.SMEM((BLOCK_M,), jnp.int32),
        plgpu.SMEM((BLOCK_M,), jnp.int32),
        plgpu.SMEM((num_words, BLOCK_M), jnp.int32) if has_tree else None,
        plgpu.SMEM(tile_table.shape[2:], jnp.int32) if paged else None,
        plgpu.SMEM((NUM_BOUNDS,), jnp.int32),
        # bf16 partials (one more bf16 rounding before the f32 combine) leave SMEM for 4 stages.
        plgpu.SMEM((C, BLOCK_M, Dh), jnp.bfloat16),
        plgpu.SMEM((C, BLOCK_M), f32),
        plgpu.SMEM((C, BLOCK_M, block_kv), jnp.bfloat16,
                   transforms=_transforms(block_kv, jnp.bfloat16)),
        plgpu.Barrier(num_arrivals=4 + has_tree + paged),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        # The scales get their own barriers (one TMA arrival per phase everywhere).
        plgpu.Barrier(num_barriers=stages) if fp8 else None,
        plgpu.Barrier(num_barriers=stages) if fp8 else None,
        # Released by the one compute warpgroup that consumed the slot.
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        collective_axes="wg",
    )

  P = num_splits * C
  out_type = (jax.ShapeDtypeStruct((P, BK, Mpad, Dh), jnp.bfloat16),
              jax.ShapeDtypeStruct((P, BK, Mpad), jnp.float32))
  args = [q_packed, k_cache, v_cache]
  if fp8:
    args += [k_scale, v_scale]
  args += [q_pos, chunk_start]
  if has_tree:
    args.append(tree_bits)
  if paged:
    args.append(tile_table)
  args.append(bounds)
  return plgpu.kernel(
      body, out_type=out_type, grid=(num_m, num_splits, BK), grid_names=("m", "split", "bk"),
      num_threads=C + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(*args)
