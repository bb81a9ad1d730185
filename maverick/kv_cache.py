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

from maverick.config import Config

# Logical axes of one layer's K or V, for sharding rules (batch, sequence, kv heads, head dim).
KV_AXES = ("batch", "cache_seq", "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
  k: tuple[jax.Array, ...]  # per layer [B, S, K, Dh]
  v: tuple[jax.Array, ...]
  lengths: jax.Array  # [B] int32, tokens already written per row

  @property
  def capacity(self) -> int:
    return self.k[0].shape[1]

  @property
  def batch_size(self) -> int:
    return self.k[0].shape[0]

  @classmethod
  def init(cls, cfg: Config, batch_size: int, capacity: int, dtype=None,
           num_layers: int | None = None) -> "KVCache":
    dtype = jnp.dtype(dtype or cfg.dtype)
    n = cfg.num_hidden_layers if num_layers is None else num_layers
    shape = (batch_size, capacity, cfg.num_key_value_heads, cfg.head_dim)
    zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(n))
    return cls(k=zeros(), v=zeros(), lengths=jnp.zeros((batch_size,), jnp.int32))

  def with_lengths(self, lengths: jax.Array) -> "KVCache":
    return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))


def write(cache_layer: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
  """Writes new [B, T, K, Dh] into cache_layer [B, S, K, Dh] at per-row slot starts [B].

  Callers guarantee starts + T <= S (generate checks capacity on the host); dynamic_update_slice
  would otherwise clamp the start and silently shift the write.
  """
  row_write = lambda c, x, s: jax.lax.dynamic_update_slice_in_dim(c, x.astype(c.dtype), s, axis=0)
  return jax.vmap(row_write)(cache_layer, new, starts)
