"""Blackwell (sm_100) split-K decode / verify attention over a KV cache (flash-decoding), on tcgen05
with the scores and the output accumulator in TMEM.

Same contract, grid and visibility rules as sm90.py (read its docstring first): one CTA per (query
tile, split, batch row x kv head); the G = H // K query heads of every new token are packed into
the MMA M dimension (row m = t * G + g), here padded to 128 rows, the tcgen05 M of one CTA; each
CTA walks its share of the row's visible KV blocks (bounds per (row, split) from api.py).

Structure (warp specialised, as on sm90, for the same reason: the tensor core and TMA stay busy
while one warpgroup does its softmax):
  warpgroup `compute_wgs` (producer, few registers): TMA of the query tile and per-row vectors,
    then K/V tiles (and fp8 scales) into a `stages`-deep ring of swizzled SMEM slots; a slot is
    refilled as soon as its consumer releases it.
  compute warpgroup w (of compute_wgs) takes KV steps w, w + compute_wgs, ... with its own TMEM:
    S = Q K^T (tcgen05, 128 x block_kv f32 in TMEM) -> registers (one row per thread, so the row
    max / sum are in-thread) -> scale, mask, online softmax in f32 (base 2) -> P as bf16 to SMEM;
    its running O (128 x Dh f32 in TMEM) is rescaled in place by alpha (64-column chunks through
    registers, skipped on the first step), then O += P V (tcgen05, accumulating in TMEM). Each MMA
    is committed to the warpgroup's own tensor-core barrier and waited on before its result is
    read or its operands are reused; after the P V MMA completes the K and V slots go back to
    the producer. Each compute warpgroup writes its own normalised bf16 partial and log2-sum-exp
    (P = num_splits * compute_wgs partials, merged by api.combine in XLA). The output is staged
    through the warpgroup's P buffer, block_kv columns at a time.
TMEM: compute_wgs * (block_kv + Dh) columns (384 of 512 at Dh=128, 2 compute warpgroups).
FP8 KV (e4m3): the tile is converted to bf16 in SMEM (one conversion buffer per compute
warpgroup, as sm90; q is bf16, so kind::f16 MMAs), the k scale multiplies the scores and the v
scale the probabilities, per slot.
SMEM at Dh=128, block_kv=64, 2 compute warpgroups: bf16 4 stages ~196 KiB; fp8 4 stages ~166 KiB
(see `smem_plan`; 6 would fit, but a power-of-two ring keeps the consumer in its registers).
Not done (FA4-style): lazy O rescaling (skip when the row max barely moves), S/P aliasing in
TMEM, a dedicated MMA warp.
"""

from __future__ import annotations

import jax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax import lax

from pallas_kernels import common
from pallas_kernels.decode_attention import stream
from pallas_kernels.decode_attention.sm90 import LOG2E, NUM_BOUNDS, _fp8_to_bf16, _transforms

BLOCK_M = 128  # the tcgen05 M of one CTA
MAX_STAGES = 6
SMEM_BUDGET = 200 * 1024
# Registers: Mosaic GPU builds kernels through nvJitLink as relocatable code, where ptxas ignores
# `setmaxnreg` (info C7504), so each of the 3 warpgroups' threads gets 65536 / 384 -> 168
# registers, the consumer's 232 never. What keeps the consumer under that (ptxas, sm_100a, no
# spills): P is stored before O is rescaled, O is rescaled 32 columns at a time, and the ring
# has a power-of-two depth (6 stages spilled 212 B with FP8).
RESCALE_COLS = 32


def smem_bytes(Dh: int, block_kv: int, kv_itemsize: int, compute_wgs: int, stages: int,
               num_words: int = 4) -> int:
  """SMEM of one CTA (barriers aside)."""
  fp8 = kv_itemsize == 1
  per_stage = 2 * block_kv * Dh * kv_itemsize + (2 * block_kv * 4 if fp8 else 0)
  fixed = (BLOCK_M * Dh * 2  # q
           + compute_wgs * BLOCK_M * block_kv * 2  # P (and the output staging)
           + compute_wgs * BLOCK_M * 4  # lse
           + (2 + num_words) * BLOCK_M * 4 + NUM_BOUNDS * 4)  # per-row vectors, bounds
  if fp8:
    fixed += compute_wgs * block_kv * Dh * 2  # bf16 conversion buffers
  return fixed + stages * per_stage


def smem_plan(Dh: int, block_kv: int, kv_itemsize: int, compute_wgs: int) -> int:
  """Pipeline depth that keeps one CTA's SMEM under ~200 KiB (one CTA per SM), a multiple of
  compute_wgs (see sm90.smem_plan) and a power of two (registers, see RESCALE_COLS)."""
  stages = MAX_STAGES
  while stages > compute_wgs and (
      smem_bytes(Dh, block_kv, kv_itemsize, compute_wgs, stages) > SMEM_BUDGET
      or stages % compute_wgs or stages & (stages - 1)):
    stages -= 1
  return max(compute_wgs, stages)


def split_attention(q_packed, k_cache, v_cache, k_scale, v_scale, q_pos, chunk_start, tree_bits,
                    bounds, *, num_kv_heads: int, num_splits: int, block_kv: int,
                    sm_scale: float, compute_wgs: int, stages: int | None = None,
                    tile_table=None):
  """The contract of sm90.split_attention with Mpad a multiple of BLOCK_M = 128:
  q_packed [B*K, Mpad, Dh] bf16; k/v_cache [B, S, K, Dh]; k/v_scale [B, K, S] f32 or None;
  q_pos / chunk_start [B, Mpad] int32; tree_bits [B, W, Mpad] int32 or None;
  bounds [B, num_splits, 4] int32; tile_table (paged cache) as sm90's. Returns (out [P, B*K, Mpad, Dh] bf16 normalised per partial,
  lse [P, B*K, Mpad] f32 in log2 units, -inf where a partial saw nothing),
  P = num_splits * compute_wgs."""
  BK, Mpad, Dh = q_packed.shape
  K = num_kv_heads
  paged = tile_table is not None
  assert Mpad % BLOCK_M == 0 and Dh % block_kv == 0, (Mpad, Dh, block_kv)
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
  p_tr = _transforms(block_kv, jnp.bfloat16)
  layout = plgpu.Layout.TCGEN05
  row_layout = layout.reduce(1)
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

    def scoped(q_s, k_s, v_s, kvb_s, ks_s, vs_s, pos_s, cs_s, bits_s, tiles_s, bounds_s, lse_s, p_s,
               s_tmem, o_tmem, meta_bar, k_bar, v_bar, ks_bar, vs_bar, k_free, v_free, mma_bar):
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
        my_s = s_tmem.at[:, pl.ds(wg * block_kv, block_kv)]
        my_o = o_tmem.at[:, pl.ds(wg * Dh, Dh)]
        my_bar = mma_bar.at[wg]
        o_cols = [pl.ds(c, block_kv) for c in range(0, Dh, block_kv)]
        chunk = (BLOCK_M, block_kv)

        def mma_and_wait(acc, a, b_op, accumulate):
          plgpu.tcgen05_mma(acc, a, b_op, accumulate=accumulate)
          plgpu.tcgen05_commit_arrive(my_bar)
          plgpu.barrier_wait(my_bar)

        def kv_step(j, carry):
          m_i, l_i = carry
          step = wg + j * C
          slot = lax.rem(step, jnp.int32(stages))
          plgpu.barrier_wait(k_bar.at[slot])
          if fp8:
            my_kvb[...] = _fp8_to_bf16(k_s[slot])
            plgpu.commit_smem()
            k_op = my_kvb
          else:
            k_op = k_s.at[slot]
          mma_and_wait(my_s, q_s, k_op.T, False)
          s = plgpu.async_load_tmem(my_s, layout=layout)
          k_scale_row = None
          if fp8:
            plgpu.barrier_wait(ks_bar.at[slot])
            k_scale_row = plgpu.load(ks_s.at[slot], layout=layout.reduce(0))
          s = stream.masked_scores(
              s, layout=layout, score_scale=score_scale, k_scale_row=k_scale_row,
              first_slot=(first_block + step) * block_kv, pos_s=pos_s, cs_s=cs_s, bits_s=bits_s,
              tree_start=tree_start, tree_end=tree_end)
          p, m_new, alpha, l_i = stream.softmax_step(s, m_i, l_i)
          plgpu.wait_load_tmem()  # S is in registers before the next step's MMA overwrites it

          # P goes to SMEM before O is rescaled: P and an O chunk are never live together
          # (registers: 3 warpgroups cap a thread at 168, see stream.py).
          plgpu.barrier_wait(v_bar.at[slot])
          if fp8:
            plgpu.barrier_wait(vs_bar.at[slot])
            v_scale_row = plgpu.load(vs_s.at[slot], layout=layout.reduce(0))
            p = p * lax.broadcast_in_dim(v_scale_row, shape, [1])
            my_kvb[...] = _fp8_to_bf16(v_s[slot])  # the S MMA is done with the buffer
            v_op = my_kvb
          else:
            v_op = v_s.at[slot]
          my_p[...] = p.astype(jnp.bfloat16)

          @pl.when(j > 0)
          def _rescale_o():  # O *= alpha in TMEM (the previous P V MMA has completed)
            alpha_b = lax.broadcast_in_dim(alpha, (BLOCK_M, RESCALE_COLS), [0])
            for cols in [pl.ds(c, RESCALE_COLS) for c in range(0, Dh, RESCALE_COLS)]:
              o = plgpu.async_load_tmem(my_o.at[:, cols], layout=layout)
              plgpu.wait_load_tmem()  # read before overwritten
              plgpu.async_store_tmem(my_o.at[:, cols], o * alpha_b)
            plgpu.commit_tmem()

          plgpu.commit_smem()
          mma_and_wait(my_o, my_p, v_op, j > 0)
          # Every read of the slot (MMAs, scale loads, fp8 conversion) is behind us now.
          plgpu.barrier_arrive(k_free.at[slot])
          plgpu.barrier_arrive(v_free.at[slot])
          return m_new, l_i

        m_i = plgpu.layout_cast(jnp.full((BLOCK_M,), -jnp.inf, jnp.float32), row_layout)
        l_i = plgpu.layout_cast(jnp.zeros((BLOCK_M,), jnp.float32), row_layout)
        my_steps = lax.div(jnp.maximum(num_steps - wg + (C - 1), 0), jnp.int32(C))
        m_i, l_i = lax.fori_loop(0, my_steps, kv_step, (m_i, l_i))

        # l = 0: the partial saw nothing (O in TMEM is then 0, or never written).
        seen = l_i > 0
        seen_b = lax.broadcast_in_dim(seen, chunk, [0])
        inv_l = lax.broadcast_in_dim(1.0 / jnp.where(seen, l_i, 1.0), chunk, [0])
        part = split * C + wg
        for c, cols in enumerate(o_cols):
          o = plgpu.async_load_tmem(my_o.at[:, cols], layout=layout)
          if c:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk has left
          my_p[...] = jnp.where(seen_b, o * inv_l, 0.0).astype(jnp.bfloat16)
          plgpu.commit_smem()
          plgpu.copy_smem_to_gmem(my_p, o_g.at[part, bk, rows, cols])
        plgpu.wait_load_tmem()
        lse_s[wg] = jnp.where(seen, m_i + jnp.log2(jnp.where(seen, l_i, 1.0)), -jnp.inf)
        plgpu.commit_smem()
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
        plgpu.SMEM((C, BLOCK_M), f32),
        # P of each compute warpgroup; also stages its bf16 output, block_kv columns at a time.
        plgpu.SMEM((C, BLOCK_M, block_kv), jnp.bfloat16, transforms=p_tr),
        plgpu.TMEM((BLOCK_M, C * block_kv), f32),
        plgpu.TMEM((BLOCK_M, C * Dh), f32),
        plgpu.Barrier(num_arrivals=4 + has_tree + paged),
        plgpu.Barrier(num_barriers=stages),
        plgpu.Barrier(num_barriers=stages),
        # The scales get their own barriers (one TMA arrival per phase everywhere).
        plgpu.Barrier(num_barriers=stages) if fp8 else None,
        plgpu.Barrier(num_barriers=stages) if fp8 else None,
        # Released by the one compute warpgroup that consumed the slot.
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        # One tensor-core barrier per compute warpgroup: its MMAs' completion.
        plgpu.Barrier(num_arrivals=1, num_barriers=C, orders_tensor_core=True),
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
