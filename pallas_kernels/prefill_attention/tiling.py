"""What the sm90 and sm100 kernels share: the packed-row layout of GQA heads, padding, the KV block
range a tile can see and which blocks need the mask."""

from __future__ import annotations

import math

import jax.numpy as jnp
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

LOG2E = math.log2(math.e)
# The running max starts finite, so a row that has seen only masked keys gets exp2(-inf - m) = 0
# and alpha = exp2(m - m) = 1, never NaN; its sum stays 0 and its output is 0.
M_INIT = -1e30


def smem_transforms(cols: int, dtype):
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = plgpu.find_swizzle(cols * itemsize * 8)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def pack(q, k, v, lengths, *, block_kv: int, cta_rows: int):
  """Pads time so keys fill whole KV blocks and packed rows fill whole CTAs, and packs the G query
  heads of each kv head into rows: q [B,T,H,Dh] -> [B,K,T_pad*G,Dh], row r = (token r // G, head
  r % G). Padded keys sit at s >= T >= lengths[b], so the mask hides them."""
  B, T, H, Dh = q.shape
  K = k.shape[2]
  G = H // K
  align = math.lcm(block_kv, cta_rows // math.gcd(cta_rows, G))
  T_pad = pl.cdiv(T, align) * align
  if T_pad != T:
    pad = ((0, 0), (0, T_pad - T), (0, 0), (0, 0))
    q, k, v = (jnp.pad(x, pad) for x in (q, k, v))
  q_rows = q.reshape(B, T_pad, K, G, Dh).transpose(0, 2, 1, 3, 4).reshape(B, K, T_pad * G, Dh)
  return q_rows, k, v, jnp.clip(lengths.astype(jnp.int32), 0, T)


def unpack(out_rows, T: int, H: int):
  B, K, rows, Dh = out_rows.shape
  G = H // K
  T_pad = rows // G
  out = out_rows.reshape(B, K, T_pad, G, Dh).transpose(0, 2, 1, 3, 4).reshape(B, T_pad, H, Dh)
  return out[:, :T]


def kv_blocks(row0, num_rows: int, G: int, length, chunk_size: int | None, block_kv: int):
  """(first block, number of blocks) of keys any of rows [row0, row0 + num_rows) can see: nothing
  past the last live token (causal, lengths[b]); chunked: nothing before the first token's chunk."""
  first_tok = row0 // G
  last_tok = jnp.minimum((row0 + num_rows - 1) // G, length - 1)
  kv_lo = (first_tok // chunk_size) * chunk_size if chunk_size is not None else 0
  first_block = kv_lo // block_kv
  return first_block, jnp.maximum(pl.cdiv(last_tok + 1, block_kv) - first_block, 0)


def row_key_bounds(tok, length, chunk_size: int | None):
  """Per row, the visible keys are [lo, hi] (hi = -1: a padding row that sees nothing)."""
  hi = jnp.where(tok < length, tok, -1)
  lo = (tok // chunk_size) * chunk_size if chunk_size is not None else jnp.zeros_like(tok)
  return lo, hi


def block_needs_mask(kv0, block_kv: int, row0, num_rows: int, G: int, length,
                     chunk_size: int | None):
  """Whether keys [kv0, kv0 + block_kv) are not all visible to all rows [row0, row0 + num_rows):
  only blocks on the causal diagonal, a chunk start or the length. Rows are token-major, so the
  bounds of the rows are those of their first and last token."""
  first_tok, last_tok = row0 // G, (row0 + num_rows - 1) // G
  lo_max = (last_tok // chunk_size) * chunk_size if chunk_size is not None else 0
  hi_min = jnp.where(last_tok < length, first_tok, -1)
  return (kv0 < lo_max) | (kv0 + block_kv - 1 > hi_min)
