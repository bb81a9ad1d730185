"""Preallocated KV cache with per-row lengths.

Every layer keeps `capacity` slots per row, and slot s holds absolute position s. Rows advance
independently: a step writes T new tokens of row b at slots lengths[b] .. lengths[b]+T-1. Rolling back
(speculative rejection) is just lowering `lengths`; the stale slots are masked (a query at position p
only sees slots <= p) and overwritten by the next write. Keeping every slot on chunked layers too costs
memory but keeps masks purely positional, identical to HF at any position.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from maverick.quant import ops as quant_lib
from maverick.config import Config

# Logical axes of one layer's K or V, for sharding rules (batch, sequence, kv heads, head dim).
KV_AXES = ("batch", "cache_seq", "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # per layer [B, S, K, Dh]
  v: tuple[jax.Array, ...]
  lengths: jax.Array  # [B] int32, tokens already written per row
  # FP8 cache (Config.quant.kv_cache == "fp8"): k/v are e4m3 and these hold one f32 scale per token
  # and kv head, per layer [B, S, K]. A scale per token (not per head over the whole cache) needs no
  # calibration and keeps an outlier token from costing precision elsewhere; it adds 4 bytes per
  # Dh e4m3 values (3 % at Dh = 128). With "fp8_static" k/v are e4m3 too but these stay None: the
  # scales are per-layer scalars in the model state (Attention.k_cache_scale / v_cache_scale).
  k_scale: tuple[jax.Array, ...] | None = None
  v_scale: tuple[jax.Array, ...] | None = None

  @property
  def capacity(self) -> int:
    return self.k[0].shape[1]

  @property
  def batch_size(self) -> int:
    return self.k[0].shape[0]

  @classmethod
  def init(cls, cfg: Config, batch_size: int, capacity: int, dtype=None,
           num_layers: int | None = None) -> "KVCache":
    n = cfg.num_hidden_layers if num_layers is None else num_layers
    shape = (batch_size, capacity, cfg.num_key_value_heads, cfg.head_dim)
    lengths = jnp.zeros((batch_size,), jnp.int32)
    zeros = lambda s, dt: tuple(jnp.zeros(s, dt) for _ in range(n))
    kv_format = None if dtype is not None or cfg.quant is None else cfg.quant.kv_cache
    if kv_format == "fp8":
      return cls(k=zeros(shape, quant_lib.FP8), v=zeros(shape, quant_lib.FP8), lengths=lengths,
                 k_scale=zeros(shape[:3], jnp.float32), v_scale=zeros(shape[:3], jnp.float32))
    if kv_format == "fp8_static":
      return cls(k=zeros(shape, quant_lib.FP8), v=zeros(shape, quant_lib.FP8), lengths=lengths)
    dtype = jnp.dtype(dtype or cfg.dtype)
    return cls(k=zeros(shape, dtype), v=zeros(shape, dtype), lengths=lengths)

  @property
  def quantized(self) -> bool:
    """Per-token scales next to an FP8 cache (the dynamic mode; a static FP8 cache has none)."""
    return self.k_scale is not None

  def layer(self, i: int) -> tuple[jax.Array, ...]:
    """(k, v) of layer i, or (k, v, k_scale, v_scale) for an FP8 cache."""
    if self.quantized:
      return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]
    return self.k[i], self.v[i]

  @classmethod
  def from_layers(cls, k, v, scales, lengths) -> "KVCache":
    """Inverse of `layer` over all layers; scales: per layer () or (k_scale, v_scale)."""
    if scales and len(scales[0]) == 2:
      return cls(k=tuple(k), v=tuple(v), lengths=lengths,
                 k_scale=tuple(s[0] for s in scales), v_scale=tuple(s[1] for s in scales))
    return cls(k=tuple(k), v=tuple(v), lengths=lengths)

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))


def write(cache_layer: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
  """Writes new [B, T, K, Dh] into cache_layer [B, S, K, Dh] at per-row slot starts [B].

  Callers guarantee starts + T <= S (generate checks capacity on the host); dynamic_update_slice
  would otherwise clamp the start and silently shift the write.
  """
  row_write = lambda c, x, s: jax.lax.dynamic_update_slice_in_dim(c, x.astype(c.dtype), s, axis=0)
  return jax.vmap(row_write)(cache_layer, new, starts)
