"""The XLA reference: what a Llama 4 attention layer does between its q / k / v GEMM and the
decode kernel, written out in plain jnp (independent of maverick.model, which tests compare it
with): the GEMM's split-K sum rounded to bf16, interleaved-pair RoPE, the weightless RMS QK norm,
the NoPE layers' temperature, the new K / V written at slots start[b] + t of a contiguous cache
or through a block table into pools (bf16, FP8 with per-token-per-head scales, or FP8 with
static per-tensor scales), and q packed the way the decode kernel reads it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0
MIN_ROW_AMAX = 1.0 / 512.0  # = maverick.quant.ops.MIN_ROW_AMAX


@dataclasses.dataclass(frozen=True)
class Layer:
  """What the layer does to q and k (static: part of the kernel's cache key).
  `inv_freq`: RoPE's Dh/2 inverse frequencies (None: a NoPE layer); `qk_norm`: the weightless
  RMS norm after RoPE with `eps`; `temperature`: (floor_scale, attn_scale) of the NoPE layers'
  query scale log1p(floor((p + 1) / floor_scale)) * attn_scale + 1, or None."""
  inv_freq: tuple[float, ...] | None
  qk_norm: bool = False
  eps: float = 1e-5
  temperature: tuple[float, float] | None = None


def _bf16(x):
  return x.astype(jnp.bfloat16).astype(jnp.float32)


def product(p, rows: int):
  """A GEMM output [S, R, N] (S scaled f32 split-K partials, or S = 1 the finished product) ->
  its first `rows` rows as the bf16 values the model's einsum returns, in f32."""
  return _bf16(jnp.sum(p.astype(jnp.float32), axis=0)[:rows])


def rope(x, positions, inv_freq):
  """x [B, T, heads, Dh] f32 (bf16 values): (x[2j], x[2j+1]) rotated by positions * inv_freq[j]."""
  angles = positions.astype(jnp.float32)[:, :, None, None] * jnp.asarray(inv_freq, jnp.float32)
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x0, x1 = x[..., 0::2], x[..., 1::2]
  out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
  return _bf16(out.reshape(x.shape))


def rms(x, eps):
  return _bf16(x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def temperature(positions, floor_scale, attn_scale):
  p = positions.astype(jnp.float32)
  return jnp.log1p(jnp.floor((p + 1.0) / floor_scale)) * attn_scale + 1.0


def finish_qk(x, positions, layer: Layer, is_query: bool):
  if layer.inv_freq is not None:
    x = rope(x, positions, layer.inv_freq)
  if layer.qk_norm:
    x = rms(x, layer.eps)
  if is_query and layer.temperature is not None:
    x = _bf16(x * temperature(positions, *layer.temperature)[:, :, None, None])
  return x


def cache_entries(x, static_scale=None, dynamic: bool = False):
  """New cache entries [B, T, K, Dh] from bf16 values: (stored, per-token-per-head scales or
  None)."""
  if dynamic:
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), MIN_ROW_AMAX)
    s = amax / FP8_MAX
    return jnp.clip(x / s, -FP8_MAX, FP8_MAX).astype(FP8), s[..., 0]
  if static_scale is not None:
    q = x / jnp.asarray(static_scale, jnp.float32).reshape(())
    return jnp.clip(q, -FP8_MAX, FP8_MAX).astype(FP8), None
  return x.astype(jnp.bfloat16), None


def write(cache, new, starts, block_table=None):
  """cache [B, S, ...] (or pools [N, bs, ...] with block_table [B, M]) with new [B, T, ...] at
  slots starts[b] + t, as maverick.kv_cache writes them: a contiguous row's start is clamped to
  S - T (dynamic_update_slice's rule); a paged slot whose table entry is negative (no block) or
  past the table is dropped (an idle row must not write into a block another row holds)."""
  B, T = new.shape[:2]
  starts = starts.astype(jnp.int32)
  if block_table is None:
    starts = jnp.clip(starts, 0, cache.shape[1] - T)
  slots = starts[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  if block_table is None:
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
    return cache.at[rows, slots].set(new.astype(cache.dtype))
  N, bs = cache.shape[:2]
  j = slots // bs
  blocks = jnp.take_along_axis(block_table.astype(jnp.int32),
                               jnp.clip(j, 0, block_table.shape[1] - 1), axis=1)
  blocks = jnp.where((j < block_table.shape[1]) & (blocks >= 0), blocks, N)
  return cache.at[blocks, slots % bs].set(new.astype(cache.dtype), mode="drop")


def pack_queries(q, num_kv_heads: int, mpad: int):
  """q [B, T, H, Dh] -> [B * K, mpad, Dh]: kv head k of row b holds its G = H / K query heads
  at row t * G + g; rows T * G.. are zero."""
  B, T, H, Dh = q.shape
  K = num_kv_heads
  G = H // K
  packed = q.reshape(B, T, K, G, Dh).transpose(0, 2, 1, 3, 4).reshape(B * K, T * G, Dh)
  return jnp.pad(packed, ((0, 0), (0, mpad - T * G), (0, 0)))


def qkv_finish(q_p, k_p, v_p, positions, starts, caches, *, num_heads: int, num_kv_heads: int,
               layer: Layer, mpad: int, block_table=None, static_scales=None):
  """See api.qkv_finish."""
  B, T = positions.shape
  H, K = num_heads, num_kv_heads
  Dh = q_p.shape[-1] // H
  rows = B * T
  q = product(q_p, rows).reshape(B, T, H, Dh)
  k = product(k_p, rows).reshape(B, T, K, Dh)
  v = product(v_p, rows).reshape(B, T, K, Dh)
  q = finish_qk(q, positions, layer, True)
  k = finish_qk(k, positions, layer, False)
  dynamic = len(caches) == 4
  ks, vs = (None, None) if static_scales is None else static_scales
  (kq, k_sc), (vq, v_sc) = cache_entries(k, ks, dynamic), cache_entries(v, vs, dynamic)
  new = (kq, vq) + ((k_sc, v_sc) if dynamic else ())
  out = tuple(write(c, n, starts, block_table) for c, n in zip(caches, new))
  return pack_queries(q.astype(jnp.bfloat16), K, mpad), out
