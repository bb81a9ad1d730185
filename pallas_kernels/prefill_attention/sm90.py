"""Hopper (sm_90) prefill flash attention: causal (+ Llama 4 chunked) GQA with per-row lengths.

Layout: the G = H // K query heads that share a kv head are packed into the rows of the Q tiles:
q [B,T,H,Dh] -> [B,K,T*G,Dh] (row r = token r // G, head r % G), so each K/V tile that TMA brings
into SMEM feeds all G heads through one wgmma.

A CTA owns `num_compute_wgs * block_q` packed rows of one (batch, kv head). Warp specialization: a
producer warpgroup streams the K/V tiles by TMA into a `num_stages`-deep ring of swizzled SMEM
buffers; each compute warpgroup holds `block_q` rows (Q in SMEM, the running output, max and sum in
registers) and per KV tile does S = Q K^T (wgmma, f32), the online softmax in f32 (exp2 with the
scale folded in), P -> SMEM as bf16, O += P V (wgmma). Two compute warpgroups take turns (FA3
ping-pong) so one's softmax overlaps the other's matmuls. The CTA walks only the KV blocks its rows
can see: dynamic loop bounds from causality, the chunk start of its first token and lengths[b];
only the blocks that straddle a boundary pay for the mask.

Interpret mode vs GPU: the one difference is how P V is accumulated (see `_accumulate_pv`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.prefill_attention import tiling


@dataclasses.dataclass(frozen=True)
class Config:
  block_q: int = 64  # packed (token, head) rows per compute warpgroup (one wgmma M tile)
  block_kv: int = 128  # keys per pipeline step
  num_stages: int = 2  # K/V tiles in flight
  num_compute_wgs: int = 2  # compute warpgroups per CTA, sharing every K/V tile
  # With two compute warpgroups, alternate them (FA3 ping-pong): one's softmax runs while the
  # other's wgmmas own the tensor cores.
  ping_pong: bool = True

  def __post_init__(self):
    if self.block_q != 64 or self.block_kv % 64 or self.num_stages < 1 or self.num_compute_wgs < 1:
      raise ValueError(f"unsupported {self}")


def default_config(head_dim: int, T: int) -> Config:
  del head_dim
  # Short prompts: 64-key blocks waste less on the diagonal and on padding.
  return Config(block_kv=64 if T <= 256 else 128)


def _accumulate_pv(acc, p_smem, v_tile, *, in_place: bool):
  """acc + P V. On the GPU the wgmma accumulates into `acc`'s registers (ACC.init under
  run_state); GPU interpret mode cannot run that (the effect leaks out of its jaxpr), so there P V
  goes into a fresh accumulator that is then added: same math, 64 more live registers per thread."""
  def pv(o_ref):
    plgpu.wgmma(o_ref, p_smem, v_tile)
    return o_ref[...]
  if in_place:
    return pl.run_state(lambda o_ref: plgpu.wgmma(o_ref, p_smem, v_tile))(plgpu.ACC.init(acc))
  return acc + pl.run_scoped(pv, plgpu.ACC(acc.shape, jnp.float32))


def prefill_attention(q, k, v, lengths, *, chunk_size: int | None, sm_scale: float,
                      config: Config | None = None):
  """q [B,T,H,Dh], k/v [B,T,K,Dh] bf16, lengths [B] int32 -> [B,T,H,Dh] bf16 (validated by api)."""
  B, T, H, Dh = q.shape
  K = k.shape[2]
  G = H // K
  cfg = config or default_config(Dh, T)
  bq, bkv, wgs = cfg.block_q, cfg.block_kv, cfg.num_compute_wgs
  cta_rows = wgs * bq
  dtype = q.dtype
  q_rows, k, v, lengths = tiling.pack(q, k, v, lengths, block_kv=bkv, cta_rows=cta_rows)
  rows = q_rows.shape[2]
  num_ctas_q = rows // cta_rows
  scale_log2 = sm_scale * tiling.LOG2E
  qkv_transforms = tiling.smem_transforms(Dh, dtype)
  p_transforms = tiling.smem_transforms(bkv, dtype)
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  in_place_pv = not common.interpreting()
  ping_pong = cfg.ping_pong and wgs == 2

  def kernel(lengths_gmem, q_gmem, k_gmem, v_gmem, o_gmem, q_smem, p_smem, q_barriers,
             turn_barrier):
    def take_turns():
      # Both compute warpgroups pass here equally often (they walk the same KV blocks), so it
      # never deadlocks; warpgroup 1 starts one turn behind, warpgroup 0 catches up at the end.
      if ping_pong:
        plgpu.barrier_arrive(turn_barrier)
        plgpu.barrier_wait(turn_barrier)

    # Causal tiles near the end of the prompt have the most work: launch them first.
    cta = num_ctas_q - 1 - lax.axis_index("q")
    kvh, b = lax.axis_index("kv_head"), lax.axis_index("batch")
    length = lengths_gmem[b]
    cta_row0 = cta * cta_rows
    first_block, num_blocks = tiling.kv_blocks(cta_row0, cta_rows, G, length, chunk_size, bkv)

    def compute_wg(run_pipeline):
      wg = lax.axis_index("wg")
      row0 = cta_row0 + wg * bq
      plgpu.copy_gmem_to_smem(q_gmem.at[b, kvh, pl.ds(row0, bq)], q_smem.at[wg], q_barriers.at[wg])
      tok = (plgpu.broadcasted_iota(jnp.int32, (bq,), 0, layout=row_layout) + row0) // G
      lo, hi = tiling.row_key_bounds(tok, length, chunk_size)
      acc = plgpu.layout_cast(jnp.zeros((bq, Dh), jnp.float32), plgpu.Layout.WGMMA)
      m = plgpu.layout_cast(jnp.full((bq,), tiling.M_INIT, jnp.float32), row_layout)
      l = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)
      plgpu.barrier_wait(q_barriers.at[wg])
      pl.when(wg == 1)(take_turns)
      acc, m, l, _, _ = run_pipeline((acc, m, l, lo, hi))
      pl.when(wg == 0)(take_turns)
      inv_l = 1.0 / jnp.where(l > 0, l, 1.0)  # l = 0 only where acc = 0: output 0
      out = acc * lax.broadcast_in_dim(inv_l, (bq, Dh), [0])
      q_smem[wg] = out.astype(dtype)  # Q is dead: its SMEM stages the output tile
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem.at[wg], o_gmem.at[b, kvh, pl.ds(row0, bq)])
      plgpu.wait_smem_to_gmem(0)

    def kv_step(idx, k_tile, v_tile, k_loaded, v_loaded, k_consumed, v_consumed, carry):
      acc, m_prev, l_prev, lo, hi = carry
      wg = lax.axis_index("wg")

      # K and V have their own barriers: S = Q K^T starts as soon as K lands (V may still be in
      # flight) and the K slot goes back to the producer as soon as S is read out.
      plgpu.barrier_wait(k_loaded)

      def qk(s_ref):
        plgpu.wgmma(s_ref, q_smem.at[wg], k_tile.T)
        take_turns()  # while S = Q K^T runs
        return s_ref[...]
      s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
      plgpu.barrier_arrive(k_consumed)
      kv0 = (first_block + idx[0]) * bkv

      def scale_and_mask(s):
        key = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA) + kv0
        visible = ((key >= lax.broadcast_in_dim(lo, (bq, bkv), [0]))
                   & (key <= lax.broadcast_in_dim(hi, (bq, bkv), [0])))
        return jnp.where(visible, s * scale_log2, -jnp.inf)

      # Blocks inside the visible region (most of a long prompt) skip the mask's integer work.
      needs_mask = tiling.block_needs_mask(kv0, bkv, cta_row0 + wg * bq, bq, G, length, chunk_size)
      s = lax.cond(needs_mask, scale_and_mask, lambda s: s * scale_log2, s)
      m_new = jnp.maximum(m_prev, s.max(axis=1))
      alpha = jnp.exp2(m_prev - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, (bq, bkv), [0]))
      l_new = l_prev * alpha + p.sum(axis=1)
      p_smem[wg] = p.astype(dtype)
      plgpu.commit_smem()
      take_turns()  # softmax done: the other warpgroup's turn on the tensor cores ends
      plgpu.barrier_wait(v_loaded)

      acc = acc * lax.broadcast_in_dim(alpha, (bq, Dh), [0])
      acc = _accumulate_pv(acc, p_smem.at[wg], v_tile, in_place=in_place_pv)
      plgpu.barrier_arrive(v_consumed)
      return acc, m_new, l_new, lo, hi

    kv_spec = plgpu.BlockSpec((bkv, Dh), lambda j: (first_block + j, 0), transforms=qkv_transforms)
    pipeline = plgpu.emit_pipeline_warp_specialized(
        kv_step, grid=(num_blocks,), in_specs=[kv_spec, kv_spec],
        max_concurrent_steps=cfg.num_stages, num_compute_wgs=wgs, memory_registers=40,
        wg_axis="wg", compute_context=compute_wg, manual_produced_barriers=True,
        manual_consumed_barriers=True)
    pipeline(k_gmem.at[b, :, kvh], v_gmem.at[b, :, kvh])

  out_rows = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((B, K, rows, Dh), dtype),
      grid=(num_ctas_q, K, B),
      grid_names=("q", "kv_head", "batch"),
      num_threads=wgs + 1,
      thread_name="wg",
      scratch_types=(
          plgpu.SMEM((wgs, bq, Dh), dtype, transforms=qkv_transforms),
          plgpu.SMEM((wgs, bq, bkv), dtype, transforms=p_transforms),
          plgpu.Barrier(num_barriers=wgs),
          plgpu.Barrier(num_arrivals=wgs),  # ping-pong turns
      ),
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(lengths, q_rows, k, v)
  return tiling.unpack(out_rows, T, H)
