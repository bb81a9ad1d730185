"""Blackwell (sm_100) prefill flash attention: the sm90 kernel's tiling (packed GQA rows, dynamic
causal / chunk / length KV bounds, mask only on boundary blocks) with tcgen05 MMAs into TMEM.

A CTA owns 128 packed rows (the tcgen05 M) of one (batch, kv head); one warpgroup runs a
`num_stages`-deep TMA pipeline of swizzled K/V tiles and per tile: S = Q K^T into TMEM,
S -> registers (one row per thread), online softmax in f32, P -> SMEM as bf16, the running O in
TMEM rescaled in place by alpha, O += P V (tcgen05, accumulating in TMEM). The output is normalised on the way out.
Not warp specialized and no FA4-style lazy rescaling or S/P TMEM aliasing yet.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.prefill_attention import tiling


@dataclasses.dataclass(frozen=True)
class Config:
  block_q: int = 128  # packed (token, head) rows per CTA: the tcgen05 M
  block_kv: int = 128  # keys per pipeline step
  num_stages: int = 2  # K/V tiles in flight
  o_chunk: int = 64  # TMEM columns of O moved through registers at a time (register pressure)

  def __post_init__(self):
    if self.block_q != 128 or self.block_kv % 64 or self.num_stages < 1:
      raise ValueError(f"unsupported {self}")


def default_config(head_dim: int, T: int) -> Config:
  del head_dim
  return Config(block_kv=64 if T <= 256 else 128)


def prefill_attention(q, k, v, lengths, *, chunk_size: int | None, sm_scale: float,
                      config: Config | None = None):
  """q [B,T,H,Dh], k/v [B,T,K,Dh] bf16, lengths [B] int32 -> [B,T,H,Dh] bf16 (validated by api)."""
  B, T, H, Dh = q.shape
  K = k.shape[2]
  G = H // K
  cfg = config or default_config(Dh, T)
  bq, bkv = cfg.block_q, cfg.block_kv
  o_chunk = min(cfg.o_chunk, Dh)
  dtype = q.dtype
  q_rows, k, v, lengths = tiling.pack(q, k, v, lengths, block_kv=bkv, cta_rows=bq)
  rows = q_rows.shape[2]
  num_ctas_q = rows // bq
  scale_log2 = sm_scale * tiling.LOG2E
  qkv_transforms = tiling.smem_transforms(Dh, dtype)
  p_transforms = tiling.smem_transforms(bkv, dtype)
  layout = plgpu.Layout.TCGEN05
  row_layout = layout.reduce(1)

  def o_columns():
    return [pl.ds(c, o_chunk) for c in range(0, Dh, o_chunk)]

  def kernel(lengths_gmem, q_gmem, k_gmem, v_gmem, o_gmem):
    cta = num_ctas_q - 1 - lax.axis_index("q")  # heaviest causal tiles first
    kvh, b = lax.axis_index("kv_head"), lax.axis_index("batch")
    length = lengths_gmem[b]
    row0 = cta * bq
    first_block, num_blocks = tiling.kv_blocks(row0, bq, G, length, chunk_size, bkv)

    def scoped(q_smem, p_smem, q_barrier, mma_barrier, s_tmem, o_tmem):
      plgpu.copy_gmem_to_smem(q_gmem.at[b, kvh, pl.ds(row0, bq)], q_smem, q_barrier)
      tok = (plgpu.broadcasted_iota(jnp.int32, (bq,), 0, layout=row_layout) + row0) // G
      lo, hi = tiling.row_key_bounds(tok, length, chunk_size)
      m0 = plgpu.layout_cast(jnp.full((bq,), tiling.M_INIT, jnp.float32), row_layout)
      l0 = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_layout)
      plgpu.barrier_wait(q_barrier)

      def mma_and_wait(acc_tmem, a_smem, b_smem, accumulate):
        plgpu.tcgen05_mma(acc_tmem, a_smem, b_smem, accumulate=accumulate)
        plgpu.tcgen05_commit_arrive(mma_barrier)
        plgpu.barrier_wait(mma_barrier)

      def kv_step(idx, k_tile, v_tile, carry):
        m_prev, l_prev = carry
        mma_and_wait(s_tmem, q_smem, k_tile.T, False)
        s = plgpu.async_load_tmem(s_tmem, layout=layout)
        kv0 = (first_block + idx[0]) * bkv

        def scale_and_mask(s):
          key = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=layout) + kv0
          visible = ((key >= lax.broadcast_in_dim(lo, (bq, bkv), [0]))
                     & (key <= lax.broadcast_in_dim(hi, (bq, bkv), [0])))
          return jnp.where(visible, s * scale_log2, -jnp.inf)

        needs_mask = tiling.block_needs_mask(kv0, bkv, row0, bq, G, length, chunk_size)
        s = lax.cond(needs_mask, scale_and_mask, lambda s: s * scale_log2, s)
        m_new = jnp.maximum(m_prev, s.max(axis=1))
        alpha = jnp.exp2(m_prev - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, (bq, bkv), [0]))
        l_new = l_prev * alpha + p.sum(axis=1)
        p_smem[...] = p.astype(dtype)
        plgpu.commit_smem()

        @pl.when(idx[0] > 0)
        def _rescale_o():  # O *= alpha in TMEM, a column chunk at a time
          for cols in o_columns():
            o = plgpu.async_load_tmem(o_tmem.at[:, cols], layout=layout)
            plgpu.wait_load_tmem()  # read before overwritten
            plgpu.async_store_tmem(
                o_tmem.at[:, cols], o * lax.broadcast_in_dim(alpha, (bq, o_chunk), [0]))
          plgpu.commit_tmem()

        plgpu.wait_load_tmem()  # S is read out before the next step's MMA overwrites it
        mma_and_wait(o_tmem, p_smem, v_tile, idx[0] > 0)
        return m_new, l_new

      kv_spec = plgpu.BlockSpec((bkv, Dh), lambda j: (first_block + j, 0),
                                transforms=qkv_transforms)
      _, l = plgpu.emit_pipeline(
          kv_step, grid=(num_blocks,), in_specs=[kv_spec, kv_spec],
          max_concurrent_steps=cfg.num_stages, init_carry=(m0, l0),
      )(k_gmem.at[b, :, kvh], v_gmem.at[b, :, kvh])

      # l = 0: a row that saw no key (O in TMEM is then 0, or never written if no block ran).
      seen = lax.broadcast_in_dim(l > 0, (bq, o_chunk), [0])
      inv_l = lax.broadcast_in_dim(1.0 / jnp.where(l > 0, l, 1.0), (bq, o_chunk), [0])
      for cols in o_columns():
        o = plgpu.async_load_tmem(o_tmem.at[:, cols], layout=layout)
        q_smem[:, cols] = jnp.where(seen, o * inv_l, 0.0).astype(dtype)  # Q's SMEM stages O
      plgpu.wait_load_tmem()
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, o_gmem.at[b, kvh, pl.ds(row0, bq)])
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((bq, Dh), dtype, transforms=qkv_transforms),
        plgpu.SMEM((bq, bkv), dtype, transforms=p_transforms),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=1, orders_tensor_core=True),
        plgpu.TMEM((bq, bkv), jnp.float32),
        plgpu.TMEM((bq, Dh), jnp.float32),
    )

  out_rows = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((B, K, rows, Dh), dtype),
      grid=(num_ctas_q, K, B),
      grid_names=("q", "kv_head", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(lengths, q_rows, k, v)
  return tiling.unpack(out_rows, T, H)
