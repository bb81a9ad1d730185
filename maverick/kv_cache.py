"""Preallocated KV cache with per-row lengths.

Every layer keeps `capacity` slots per row, and slot s holds absolute position s. Rows advance
independently: a step writes T new tokens of row b at slots lengths[b] .. lengths[b]+T-1. Rolling back
(speculative rejection) is just lowering `lengths`; the stale slots are masked (a query at position p
only sees slots <= p) and overwritten by the next write. Keeping every slot on chunked layers too costs
memory but keeps masks purely positional, identical to HF at any position.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

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

  def table(self, i: int) -> None:
    """Layer i's block table: none, slot s of a row is position s (see PagedKVCache)."""
    return None

  def replaced(self, k, v, scales, lengths) -> "KVCache":
    """This cache with new layer arrays (as `from_layers`) and lengths."""
    return type(self).from_layers(k, v, scales, lengths)

  def copy_slots(self, src: jax.Array, start: jax.Array) -> "KVCache":
    """Every layer's entries (and FP8 scales) at slots src [B, R] of each row copied to slots
    start[b] .. start[b]+R-1 (a tree's accepted path moved into place)."""
    move = lambda x: write(x, jnp.take_along_axis(x, _bcast(src, x), axis=1), start)
    return _map_layers(self, move)


def write(cache_layer: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
  """Writes new [B, T, K, Dh] into cache_layer [B, S, K, Dh] at per-row slot starts [B].

  Callers guarantee starts + T <= S (generate checks capacity on the host); dynamic_update_slice
  would otherwise clamp the start and silently shift the write.
  """
  if cache_layer.shape[0] == 1:
    # One row: a plain dynamic_update_slice (one in-place launch). vmap's scatter would, on GPU,
    # become a bounds predicate + a select over the old slots + the update: three launches.
    return jax.lax.dynamic_update_slice_in_dim(cache_layer, new.astype(cache_layer.dtype),
                                               starts[0], axis=1)
  row_write = lambda c, x, s: jax.lax.dynamic_update_slice_in_dim(c, x.astype(c.dtype), s, axis=0)
  return jax.vmap(row_write)(cache_layer, new, starts)


def _bcast(idx: jax.Array, x: jax.Array) -> jax.Array:
  """idx [B, R] broadcastable along x's trailing axes (take_along_axis over axis 1)."""
  return idx.reshape(idx.shape + (1,) * (x.ndim - 2))


def _map_layers(cache, fn):
  """fn over every per-layer array (k, v and any FP8 scales); other fields kept."""
  each = lambda xs: None if xs is None else tuple(fn(x) for x in xs)
  return dataclasses.replace(cache, k=each(cache.k), v=each(cache.v), k_scale=each(cache.k_scale),
                             v_scale=each(cache.v_scale))


# ----------------------------------------------------------------------------------------------
# Paged layout (issue 29; host bookkeeping in maverick/serving/blocks.py)
# ----------------------------------------------------------------------------------------------
NO_BLOCK = -1  # = maverick.serving.blocks.NO_BLOCK: a released or not yet reserved table entry


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k", "v", "lengths", "tables", "k_scale", "v_scale"],
                   meta_fields=["layer_table"])
@dataclasses.dataclass
class PagedKVCache:
  """KV cache in fixed-size blocks shared by all rows. Layer i keeps a pool [N, bs, K, Dh] (FP8:
  plus per-token scales [N, bs, K]); row b's position p lives in block tables[b, t, p // bs] at
  offset p % bs, t = layer_table[i] (one table per block pool: "global" and "chunked" layers may
  release blocks independently, blocks.BlockManager). The model reads a row through `gather`,
  which rebuilds the contiguous [B, M*bs, K, Dh] view KVCache has, so masks, tree masks and FP8
  scales are the contiguous path's, unchanged: one attention path for both layouts."""
  k: tuple[jax.Array, ...]  # per layer [N, bs, K, Dh]
  v: tuple[jax.Array, ...]
  lengths: jax.Array  # [B] int32
  tables: jax.Array  # [B, P, M] int32 block ids, NO_BLOCK where none
  k_scale: tuple[jax.Array, ...] | None = None  # per layer [N, bs, K] (dynamic FP8)
  v_scale: tuple[jax.Array, ...] | None = None
  layer_table: tuple[int, ...] = ()  # static: which of the P tables layer i reads

  @property
  def block_size(self) -> int:
    return self.k[0].shape[1]

  @property
  def capacity(self) -> int:
    return self.tables.shape[2] * self.block_size

  @property
  def batch_size(self) -> int:
    return self.tables.shape[0]

  @property
  def quantized(self) -> bool:
    return self.k_scale is not None

  @classmethod
  def init(cls, cfg: Config, batch_size: int, num_blocks: int | Sequence[int],
           max_blocks_per_row: int, block_size: int, *, layer_table: Sequence[int] | None = None,
           dtype=None, num_layers: int | None = None) -> "PagedKVCache":
    """Empty pools and all-NO_BLOCK tables. num_blocks: per table (one int: all tables alike);
    layer_table: the table of each layer (default: all layers read table 0)."""
    n = cfg.num_hidden_layers if num_layers is None else num_layers
    layer_table = tuple(int(t) for t in (layer_table if layer_table is not None else [0] * n))
    if len(layer_table) != n:
      raise ValueError(f"layer_table has {len(layer_table)} entries for {n} layers")
    P = max(layer_table) + 1
    sizes = [num_blocks] * P if isinstance(num_blocks, int) else list(num_blocks)
    if len(sizes) != P or min(sizes) < 1 or block_size < 1 or max_blocks_per_row < 1:
      raise ValueError(f"PagedKVCache needs one num_blocks >= 1 per table ({P}), block_size >= 1 "
                       f"and max_blocks_per_row >= 1; got {num_blocks}, {block_size}, "
                       f"{max_blocks_per_row}")
    contiguous = KVCache.init(cfg, 1, block_size, dtype, num_layers=n)  # dtypes and FP8 mode
    pool = lambda x, i: jnp.zeros((sizes[layer_table[i]],) + x.shape[1:], x.dtype)
    each = lambda xs: None if xs is None else tuple(pool(x, i) for i, x in enumerate(xs))
    return cls(k=each(contiguous.k), v=each(contiguous.v),
               lengths=jnp.zeros((batch_size,), jnp.int32),
               tables=jnp.full((batch_size, P, max_blocks_per_row), NO_BLOCK, jnp.int32),
               k_scale=each(contiguous.k_scale), v_scale=each(contiguous.v_scale),
               layer_table=layer_table)

  def layer(self, i: int) -> tuple[jax.Array, ...]:
    """Layer i's pools: (k, v) or (k, v, k_scale, v_scale), as KVCache.layer."""
    if self.quantized:
      return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]
    return self.k[i], self.v[i]

  def table(self, i: int) -> jax.Array:
    """[B, M] block table of layer i."""
    return self.tables[:, self.layer_table[i]]

  def with_lengths(self, lengths: jax.Array) -> "PagedKVCache":
    return dataclasses.replace(self, lengths=lengths.astype(jnp.int32))

  def with_tables(self, tables: jax.Array) -> "PagedKVCache":
    return dataclasses.replace(self, tables=jnp.asarray(tables, jnp.int32))

  def replaced(self, k, v, scales, lengths) -> "PagedKVCache":
    new = KVCache.from_layers(k, v, scales, lengths)
    return dataclasses.replace(self, k=new.k, v=new.v, k_scale=new.k_scale, v_scale=new.v_scale,
                               lengths=new.lengths)

  def copy_slots(self, src: jax.Array, start: jax.Array) -> "PagedKVCache":
    """As KVCache.copy_slots, through each layer's block table."""
    out = {}
    for name in ("k", "v", "k_scale", "v_scale"):
      xs = getattr(self, name)
      if xs is not None:
        out[name] = tuple(
            write_paged(x, read_slots(x, self.table(i), src), start, self.table(i))
            for i, x in enumerate(xs))
    return dataclasses.replace(self, **out)


def write_paged(pool: jax.Array, new: jax.Array, starts: jax.Array, table: jax.Array) -> jax.Array:
  """Writes new [B, T, ...] at positions starts[b] + t of each row into pool [N, bs, ...]: block
  table[b, p // bs], offset p % bs. A position whose entry is NO_BLOCK, or past the table, is
  dropped (a finished row's idle writes must not land in a block another request now holds)."""
  N, bs = pool.shape[:2]
  B, T = new.shape[:2]
  pos = starts[:, None].astype(jnp.int32) + jnp.arange(T, dtype=jnp.int32)[None, :]
  j = pos // bs
  blk = jnp.take_along_axis(table, jnp.clip(j, 0, table.shape[1] - 1), axis=1)
  blk = jnp.where((j < table.shape[1]) & (blk >= 0), blk, N)  # N: out of range, dropped
  return pool.at[blk, pos % bs].set(new.astype(pool.dtype), mode="drop")


def gather(pool: jax.Array, table: jax.Array) -> jax.Array:
  """The contiguous view [B, M*bs, ...] of pool [N, bs, ...] through table [B, M]: slot s of row
  b is position s, as in KVCache. NO_BLOCK entries read block 0, whatever it holds: they are
  either past the row's length (never reserved; the causal / tree mask hides slots past every
  query), or released blocks of a chunk-local layer, which blocks.BlockManager releases only
  before the chunk of the lowest position any query or rollback can reach, so the chunk mask
  hides them. Masked scores are replaced (not scaled), and block 0 holds finite K/V (zeros or
  written entries), so its values never reach an output."""
  B, M = table.shape
  rows = jnp.take(pool, jnp.where(table >= 0, table, 0), axis=0)  # [B, M, bs, ...]
  return rows.reshape((B, M * pool.shape[1]) + pool.shape[2:])


def read_slots(pool: jax.Array, table: jax.Array, slots: jax.Array) -> jax.Array:
  """Entries of pool at positions slots [B, R] of each row -> [B, R, ...]."""
  bs = pool.shape[1]
  blk = jnp.take_along_axis(table, jnp.clip(slots // bs, 0, table.shape[1] - 1), axis=1)
  return pool[jnp.where(blk >= 0, blk, 0), slots % bs]
