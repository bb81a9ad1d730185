"""Hopper (sm_90) prefill flash attention: causal (+ Llama 4 chunked) GQA with per-row lengths.

Layout: the G = H // K query heads that share a kv head are packed into the rows of one Q tile:
q [B,T,H,Dh] -> [B,K,T*G,Dh] (row r = token r // G, head r % G), so each K/V tile that TMA brings
into SMEM feeds all G heads with one wgmma. A CTA owns `block_q` packed rows of one (batch, kv head)
and walks only the KV blocks its rows can see (dynamic loop bounds from causality, the chunk start
and lengths[b]), with K/V streamed through a multi-stage TMA pipeline in swizzled SMEM.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

_LOG2E = math.log2(math.e)
# Running max starts finite so fully masked rows give exp2(-inf - m) = 0 and alpha = 1, never NaN.
_M_INIT = -1e30


@dataclasses.dataclass(frozen=True)
class Config:
  block_q: int = 64  # packed (token, head) rows per compute warpgroup
  block_kv: int = 128  # keys per pipeline step
  num_stages: int = 2  # K/V tiles in flight


def default_config(head_dim: int, T: int) -> Config:
  # Small T: a 64-key block wastes less on the causal diagonal and padding.
  return Config(block_kv=64 if T <= 64 else 128)


def _transforms(cols: int, itemsize: int):
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def prefill_attention(q, k, v, lengths, *, chunk_size: int | None, sm_scale: float,
                      config: Config | None = None):
  """q [B,T,H,Dh], k/v [B,T,K,Dh] bf16, lengths [B] int32 -> [B,T,H,Dh] bf16 (validated by api)."""
  B, T, H, Dh = q.shape
  K = k.shape[2]
  G = H // K
  cfg = config or default_config(Dh, T)
  bq, bkv = cfg.block_q, cfg.block_kv
  dtype = q.dtype

  # Pad time to whole KV blocks (and so whole packed Q tiles: T_pad * G rows, bq | bkv). Padded keys
  # sit at s >= T >= lengths[b], so the mask hides them; padded query rows are sliced off.
  T_pad = pl.cdiv(T, bkv) * bkv
  pad = ((0, 0), (0, T_pad - T), (0, 0), (0, 0))
  if T_pad != T:
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
  rows = T_pad * G
  q_rows = q.reshape(B, T_pad, K, G, Dh).transpose(0, 2, 1, 3, 4).reshape(B, K, rows, Dh)
  lengths = jnp.minimum(lengths.astype(jnp.int32), T)
  num_q_tiles = rows // bq
  scale_log2 = sm_scale * _LOG2E
  qkv_transforms = _transforms(Dh, jnp.dtype(dtype).itemsize)
  p_transforms = _transforms(bkv, jnp.dtype(dtype).itemsize)

  def kernel(lengths_gmem, q_gmem, k_gmem, v_gmem, o_gmem):
    qi, kvh, b = lax.axis_index("q"), lax.axis_index("kv_head"), lax.axis_index("batch")
    length = lengths_gmem[b]
    row0 = qi * bq
    first_tok = row0 // G
    last_tok = jnp.minimum((row0 + bq - 1) // G, length - 1)
    # Visible keys of this tile: [kv_lo, kv_hi). Causal: nothing past the last token; chunked: nothing
    # before the first token's chunk start; nothing at or past lengths[b].
    kv_lo = (first_tok // chunk_size) * chunk_size if chunk_size is not None else 0
    kv_hi = last_tok + 1
    first_block = kv_lo // bkv
    num_blocks = jnp.maximum(pl.cdiv(kv_hi, bkv) - first_block, 0)

    def scoped(q_smem, p_smem, bar):
      plgpu.copy_gmem_to_smem(q_gmem.at[b, kvh, pl.ds(row0, bq)], q_smem, bar)
      plgpu.barrier_wait(bar)
      tok = (plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 0, layout=plgpu.Layout.WGMMA) + row0) // G
      key_offset = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA)
      if chunk_size is not None:
        chunk_start = (tok // chunk_size) * chunk_size
      row_live = tok < length

      def step(idx, k_smem, v_smem, carry):
        acc, m_prev, l_prev = carry
        kv0 = (first_block + idx[0]) * bkv

        def qk(s_ref):
          plgpu.wgmma(s_ref, q_smem, k_smem.T)
          return s_ref[...]
        s = pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))
        key = key_offset + kv0
        visible = (key <= tok) & (key < length) & row_live
        if chunk_size is not None:
          visible = visible & (key >= chunk_start)
        s = jnp.where(visible, s * scale_log2, -jnp.inf)
        m_new = jnp.maximum(m_prev, s.max(axis=1))
        alpha = jnp.exp2(m_prev - m_new)
        p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
        l_new = l_prev * alpha + p.sum(axis=1)
        p_smem[...] = p.astype(dtype)
        plgpu.commit_smem()

        # P V into a fresh accumulator, added to the rescaled running one: storing into a wgmma
        # accumulator (or ACC.init under run_state) does not run in GPU interpret mode.
        def pv(o_ref):
          plgpu.wgmma(o_ref, p_smem, v_smem)
          return o_ref[...]
        acc = acc * lax.broadcast_in_dim(alpha, (bq, Dh), [0])
        acc = acc + pl.run_scoped(pv, plgpu.ACC((bq, Dh), jnp.float32))
        return acc, m_new, l_new

      kv_spec = plgpu.BlockSpec((bkv, Dh), lambda j: (first_block + j, 0), transforms=qkv_transforms)
      acc0 = plgpu.layout_cast(jnp.zeros((bq, Dh), jnp.float32), plgpu.Layout.WGMMA)
      m0 = plgpu.layout_cast(jnp.full((bq,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      l0 = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
      acc, _, l = plgpu.emit_pipeline(
          step, grid=(num_blocks,), in_specs=[kv_spec, kv_spec],
          max_concurrent_steps=cfg.num_stages, init_carry=(acc0, m0, l0),
      )(k_gmem.at[b, :, kvh], v_gmem.at[b, :, kvh])
      # Rows with no visible key (padding rows) have l = 0 and acc = 0: output 0, not NaN.
      inv_l = 1.0 / jnp.where(l > 0, l, 1.0)
      out = acc * lax.broadcast_in_dim(inv_l, (bq, Dh), [0])
      q_smem[...] = out.astype(dtype)  # Q is dead: reuse its SMEM for the output tile
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_smem, o_gmem.at[b, kvh, pl.ds(row0, bq)])
      plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(
        scoped,
        plgpu.SMEM((bq, Dh), dtype, transforms=qkv_transforms),
        plgpu.SMEM((bq, bkv), dtype, transforms=p_transforms),
        plgpu.Barrier(num_arrivals=1),
    )

  out_rows = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((B, K, rows, Dh), dtype),
      grid=(num_q_tiles, K, B),
      grid_names=("q", "kv_head", "batch"),
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(lengths, q_rows, k, v)
  out = out_rows.reshape(B, K, T_pad, G, Dh).transpose(0, 2, 1, 3, 4).reshape(B, T_pad, H, Dh)
  return out[:, :T]
