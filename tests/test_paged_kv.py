"""Paged KV cache (maverick.kv_cache.PagedKVCache): the model on a paged cache gives exactly the
contiguous cache's logits (the same attention after the gather), with shuffled block tables, chunk-
local release (NO_BLOCK entries before the current chunk, their blocks overwritten with garbage as
if another request took them) and free blocks full of garbage, for prefill, decode, a K+1 verify
and a tree verify, in bf16 and FP8 (per-token and static scales) KV."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maverick import config as config_lib
from maverick import kv_cache as kvc
from maverick import model as model_lib
from maverick.quant import config as quant_config
from maverick.serving import blocks
from spec_decode import tree as tree_lib

BS, CHUNK = 4, 16  # block size; the config's attention chunk (64 = 4 chunks of context below)
M = 20  # blocks per row: capacity 80
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 6, 3, 8]  # a verify tree (index 0 the root), depths up to 4


def _config(kv: str | None):
  cfg = config_lib.tiny("bfloat16" if kv is None else "float32")
  cfg = cfg.replace(moe_layers=(), num_hidden_layers=4, no_rope_layers=cfg.no_rope_layers[:4],
                    layer_types=cfg.layer_types[:4])
  assert cfg.attention_chunk_size == CHUNK and any(cfg.is_chunked(i) for i in range(4))
  assert not all(cfg.is_chunked(i) for i in range(4))
  if kv is not None:
    cfg = cfg.replace(quant=quant_config.QuantConfig(weights=None, kv_cache=kv))
  return cfg


def _garbage(cache, rng):
  """Every pool entry random (finite): a read of a block the table does not name shows up."""
  def fill(x):
    g = jnp.asarray(rng.normal(0, 3, x.shape), jnp.float32)
    return g.astype(x.dtype) if x.dtype != jnp.float32 or x.ndim == 4 else jnp.abs(g) + 0.1
  each = lambda xs: None if xs is None else tuple(fill(x) for x in xs)
  return dataclasses.replace(cache, k=each(cache.k), v=each(cache.v), k_scale=each(cache.k_scale),
                             v_scale=each(cache.v_scale))


class Pager:
  """Shuffled block tables for a paged cache, and chunk-local release on the chunked table."""

  def __init__(self, cfg, batch, rng):
    self.layer_table = tuple(int(cfg.is_chunked(i)) for i in range(cfg.num_hidden_layers))
    n = batch * M + 7  # spare blocks
    self.tables = np.stack([rng.permutation(n)[:batch * M].reshape(batch, M) for _ in range(2)],
                           axis=1)  # [B, P, M]
    self.rng, self.num_blocks = rng, n

  def init(self, cfg, batch):
    cache = kvc.PagedKVCache.init(cfg, batch, self.num_blocks, M, BS, layer_table=self.layer_table)
    return _garbage(cache, self.rng).with_tables(self.tables)

  def release(self, cache):
    """Chunk-local release at each row's length (as blocks.BlockManager.release_invisible): the
    released blocks get NO_BLOCK and fresh garbage, as if another request now wrote them."""
    lengths = np.asarray(cache.lengths)
    tables = np.array(cache.tables)
    freed = []
    for b, n in enumerate(lengths):
      for j in range(blocks.visible_blocks(int(n), CHUNK, BS)):
        if tables[b, 1, j] != kvc.NO_BLOCK:
          freed.append(tables[b, 1, j])
          tables[b, 1, j] = kvc.NO_BLOCK
    if not freed:
      return cache.with_tables(tables)
    idx = jnp.asarray(freed)
    scramble = lambda xs, pick: None if xs is None else tuple(
        x.at[idx].set(jnp.roll(x, 1, axis=0)[idx]) if pick(i) else x for i, x in enumerate(xs))
    chunked = lambda i: self.layer_table[i] == 1
    return dataclasses.replace(
        cache, tables=jnp.asarray(tables), k=scramble(cache.k, chunked),
        v=scramble(cache.v, chunked), k_scale=scramble(cache.k_scale, chunked),
        v_scale=scramble(cache.v_scale, chunked))


def _run(model, cache, release, rng_seed: int = 3):
  """Prefill, decode, a K+1 verify, a tree verify + path commit, decode: all logits."""
  V = model.config.vocab_size
  rng = np.random.default_rng(rng_seed)
  lens = np.array([37, 45], np.int32)
  prompt = rng.integers(0, V, (2, 45)).astype(np.int32)
  logits = []
  step = lambda toks, c, **kw: model_lib.apply(*nnx_split(model), jnp.asarray(toks), cache=c, **kw)
  out = step(prompt, cache, prefill=True)
  logits.append(out.logits)
  cache = out.cache.with_lengths(jnp.asarray(lens))
  for t in range(6):
    cache = release(cache)
    out = step(rng.integers(0, V, (2, 1)), cache)
    logits.append(out.logits)
    cache = out.cache
  cache = release(cache)
  out = step(rng.integers(0, V, (2, 4)), cache)  # a K+1 = 4 verify window, all kept
  logits.append(out.logits)
  cache = out.cache
  for t in range(6):  # lengths 53, 61: the tree of row 1 crosses the chunk boundary at 64
    cache = release(cache)
    out = step(rng.integers(0, V, (2, 1)), cache)
    logits.append(out.logits)
    cache = out.cache
  cache = release(cache)
  L = cache.lengths
  T = len(PARENTS)
  paths = [[j] for j in range(T)]
  for p in paths:
    while PARENTS[p[-1]] >= 0:
      p.append(PARENTS[p[-1]])
  depth = jnp.asarray([len(p) - 1 for p in paths])
  anc = np.array([[i in paths[j] for i in range(T)] for j in range(T)])
  tree = model_lib.TreeMask(start=L, positions=L[:, None] + depth[None],
                            visible=jnp.broadcast_to(jnp.asarray(anc), (2, T, T)))
  out = model_lib.apply(*nnx_split(model), jnp.asarray(rng.integers(0, V, (2, T))),
                        L[:, None] + depth[None], cache, tree=tree)
  logits.append(out.logits)
  path = jnp.asarray([paths[9][::-1], paths[7][::-1]], jnp.int32)  # [0,1,3,8,9], [0,2,5,6,7]
  cache = tree_lib.commit_path(out.cache, L, path).with_lengths(L + path.shape[1])
  for t in range(3):  # reads the moved path
    cache = release(cache)
    out = step(rng.integers(0, V, (2, 1)), cache)
    logits.append(out.logits)
    cache = out.cache
  assert int(cache.lengths.max()) > 4 * CHUNK  # past 4 chunks
  return [np.asarray(x, np.float32) for x in logits], cache


def nnx_split(model):
  from flax import nnx
  return nnx.split(model)


@pytest.mark.parametrize("kv", [None, "fp8", "fp8_static"])
def test_paged_logits_equal_contiguous(kv):
  """Bitwise-equal logits at every step: contiguous cache of the same capacity vs paged with
  shuffled tables and chunk-local release; the paged path's final cache holds the contiguous
  one's entries at the table's blocks."""
  cfg = _config(kv)
  model = model_lib.init_model(cfg, seed=1)
  if kv == "fp8_static":  # scales that do not clip (a placeholder 1.0 would)
    for layer in model.layers:
      layer.attn.k_cache_scale[...] = jnp.float32(0.02)
      layer.attn.v_cache_scale[...] = jnp.float32(0.03)
  want, ref = _run(model, kvc.KVCache.init(cfg, 2, M * BS), lambda c: c)
  pager = Pager(cfg, 2, np.random.default_rng(0))
  got, paged = _run(model, pager.init(cfg, 2), pager.release)
  assert isinstance(paged, kvc.PagedKVCache) and paged.quantized == (kv == "fp8")
  if kv is not None:
    assert paged.k[0].dtype == jnp.float8_e4m3fn
  assert len(got) == len(want)
  for i, (g, w) in enumerate(zip(got, want)):
    np.testing.assert_array_equal(g, w, err_msg=f"call {i}")
  # Every layer's entries below each row's length, through the table, are the contiguous ones
  # (chunked layers: from the first visible block on).
  for i in range(cfg.num_hidden_layers):
    view = np.asarray(kvc.gather(paged.k[i], paged.table(i)).astype(jnp.float32))
    ref_k = np.asarray(ref.k[i].astype(jnp.float32))
    for b, n in enumerate(np.asarray(paged.lengths)):
      lo = blocks.first_visible(int(n), CHUNK) if cfg.is_chunked(i) else 0
      np.testing.assert_array_equal(view[b, lo:n], ref_k[b, lo:n], err_msg=f"layer {i} row {b}")


def test_write_paged_and_gather_against_numpy():
  """Scatter / gather slot arithmetic against a NumPy loop: block table[b, p // bs], offset
  p % bs; NO_BLOCK entries and positions past the table drop the write."""
  rng = np.random.default_rng(5)
  N, bs, K, D, B, Mr = 11, 4, 2, 3, 2, 4
  pool = rng.normal(size=(N, bs, K, D)).astype(np.float32)
  table = np.array([[7, 2, kvc.NO_BLOCK, 9], [0, 5, 3, kvc.NO_BLOCK]], np.int32)
  starts = np.array([3, 9], np.int32)
  T = 7  # row 0: positions 3..9 (8..9 in a NO_BLOCK block); row 1: 9..15 (12..15 NO_BLOCK)
  new = rng.normal(size=(B, T, K, D)).astype(np.float32)
  want = pool.copy()
  for b in range(B):
    for t in range(T):
      p = starts[b] + t
      if p // bs < Mr and table[b, p // bs] != kvc.NO_BLOCK:
        want[table[b, p // bs], p % bs] = new[b, t]
  got = np.asarray(kvc.write_paged(jnp.asarray(pool), jnp.asarray(new), jnp.asarray(starts),
                                   jnp.asarray(table)))
  np.testing.assert_array_equal(got, want)
  view = np.asarray(kvc.gather(jnp.asarray(got), jnp.asarray(table)))
  for b in range(B):
    for s in range(Mr * bs):
      blk = table[b, s // bs]
      np.testing.assert_array_equal(view[b, s], want[max(blk, 0), s % bs])
  slots = np.array([[1, 6], [4, 10]], np.int32)
  read = np.asarray(kvc.read_slots(jnp.asarray(got), jnp.asarray(table), jnp.asarray(slots)))
  for b in range(B):
    for r in range(2):
      np.testing.assert_array_equal(read[b, r], want[table[b, slots[b, r] // bs], slots[b, r] % bs])
  # A write at a position past the table is dropped, never clamped into the last block.
  past = kvc.write_paged(jnp.asarray(pool), jnp.asarray(new[:, :1]), jnp.asarray([16, 16]),
                         jnp.asarray(table))
  np.testing.assert_array_equal(np.asarray(past), pool)


@pytest.mark.parametrize("batch", [1, 3])
def test_contiguous_write_against_numpy(batch):
  """kv_cache.write puts row b's T new entries at slots starts[b] .. starts[b]+T-1 and leaves
  every other slot (batch 1 takes a plain dynamic_update_slice, more rows vmap's scatter)."""
  rng = np.random.default_rng(11 + batch)
  S, K, D, T = 9, 2, 3, 2
  cache = rng.normal(size=(batch, S, K, D)).astype(np.float32)
  new = rng.normal(size=(batch, T, K, D)).astype(np.float32)
  starts = np.array([5, 0, 7][:batch], np.int32)
  want = cache.copy()
  for b in range(batch):
    want[b, starts[b]:starts[b] + T] = new[b]
  got = kvc.write(jnp.asarray(cache), jnp.asarray(new), jnp.asarray(starts))
  np.testing.assert_array_equal(np.asarray(got), want)


def test_paged_init_checks_and_no_block_constant():
  cfg = _config(None)
  assert kvc.NO_BLOCK == blocks.NO_BLOCK
  with pytest.raises(ValueError, match="layer_table has 2 entries for 4 layers"):
    kvc.PagedKVCache.init(cfg, 2, 8, 4, BS, layer_table=[0, 1])
  with pytest.raises(ValueError, match="num_blocks >= 1 per table"):
    kvc.PagedKVCache.init(cfg, 2, [8], 4, BS, layer_table=[0, 1, 1, 0])
  cache = kvc.PagedKVCache.init(cfg, 3, [8, 5], 4, BS, layer_table=[0, 1, 1, 0])
  assert cache.k[1].shape == (5, BS, cfg.num_key_value_heads, cfg.head_dim)
  assert cache.k[0].shape[0] == 8 and cache.tables.shape == (3, 2, 4)
  assert cache.capacity == 16 and cache.batch_size == 3
  assert np.all(np.asarray(cache.tables) == kvc.NO_BLOCK)
  # The layer_table is static (pytree metadata): jit keys on it, leaves are arrays only.
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(cache))
