"""Host side of the serving engine's paged KV layout (`Engine(kv_layout="paged")`, issue 29).

The device holds one block pool per layer (kv_cache.PagedKVCache) for all slots; this keeps the
block tables. Before every device call the engine sends the tables [slots, P, M] as an argument
(fixed shape: M = the row capacity in blocks, so requests coming and going never recompile). The
bookkeeping is blocks.BlockManager's: "global" pool for the NoPE layers and the EAGLE-3 draft layer,
"chunked" pool for the chunk-local layers, whose blocks before the current chunk are released.

What the host knows lags the device: the engine dispatches step t+1 before it reads step t's
results. So
  - blocks are reserved AHEAD: before a call, every position the call may write (the known length
    plus two calls' worth of tokens, one in flight and this one, plus a round's slack), capped at
    the request's prompt + max_tokens + slack;
  - tokens are committed (chunk-local release, prefix keys) BEHIND: the known length less a round's
    width + 2 (the target's K/V of the last token and the draft's of the last two are written
    later), a lower bound of what the device has written;
  - blocks freed on the host (a finished or cancelled request, a chunk-local release) may still be
    named by the table of the call in flight: that call never reads them unmasked (a finished
    row commits nothing, a released block lies before every query's chunk), and every later write
    into a reallocated block comes after it in device order (each call consumes the previous
    call's state).
Admission is by blocks: a request is admitted when the pools cover its worst case (all blocks of
prompt + max_tokens on the global pool; the chunk window plus the reserve-ahead span on the
chunked pool) on top of the worst cases every running request may still claim, so a running
request's reservation never fails and no request needs preempting.
"""

from __future__ import annotations

import numpy as np

from maverick import kv_cache as kvc
from maverick.serving import blocks


class _NoPrefixManager(blocks.BlockManager):
  """A BlockManager whose prefix cache never hits (the engine's default: prompts always prefill
  from position 0)."""

  def prefix_hit(self, prompt):
    return []


class PagedKV:
  """Block tables and admission for `slots` rows of `capacity` positions (see module docstring).

  advance: most tokens one device call adds to a row; slack: positions a round writes past the
  committed length (K+1, a tree's cache_slack, 1 for plain decoding); lag: tokens committed behind
  the known length. chunk_local=False: chunk-local layers keep all their blocks in the one pool, as
  global layers do (the layout without early release, for comparison)."""

  def __init__(self, cfg, slots: int, capacity: int, *, block_size: int, num_blocks: int,
               advance: int, slack: int, lag: int, draft: bool, prefix_cache: bool = False,
               worst_case: bool = True, chunk_local: bool = True, widths=(),
               num_chunked_blocks: int | None = None):
    if block_size < 1 or num_blocks < 1 or (num_chunked_blocks is not None
                                            and num_chunked_blocks < 1):
      raise ValueError(f"a paged KV cache needs block_size >= 1 and num_blocks >= 1, got "
                       f"block_size={block_size}, num_blocks={num_blocks}"
                       + ("" if num_chunked_blocks is None
                          else f", num_chunked_blocks={num_chunked_blocks}"))
    self.block_size, self.num_blocks = block_size, num_blocks
    self.max_blocks = -(-capacity // block_size)
    bad = [w for w in widths if not (isinstance(w, (int, np.integer)) and 1 <= w <= self.max_blocks)]
    if bad:
      raise ValueError(f"table_widths must be block counts in [1, {self.max_blocks}] (a row of "
                       f"{capacity} positions in blocks of {block_size}), got {bad}")
    self.widths = sorted({int(w) for w in widths} | {self.max_blocks})  # step-program table widths
    L = cfg.num_hidden_layers
    chunk = cfg.attention_chunk_size
    # A chunk that is not a whole number of blocks would put a chunk boundary inside a block, and
    # a released block could then hold visible positions: such layers page as global ones.
    # chunk_local=False pages them as global ones too (one pool, nothing released early).
    local = (chunk_local and chunk is not None and chunk % block_size == 0
             and any(cfg.is_chunked(i) for i in range(L)))
    if num_chunked_blocks is not None and not local:
      raise ValueError(
          "num_chunked_blocks sizes the chunk-local layers' pool, but this engine has none "
          f"(chunk_local={chunk_local}, attention_chunk_size={chunk}, block_size={block_size}: "
          "chunk-local paging needs chunked layers and a chunk that is a whole number of "
          "blocks): leave num_chunked_blocks unset")
    self.layer_table = tuple(int(local and cfg.is_chunked(i)) for i in range(L))
    pools = {blocks.GLOBAL: blocks.BlockPool(num_blocks, block_size)}
    if local:
      # A request holds about a chunk of these at once (a whole prompt while it prefills), so
      # this pool can be much smaller than the global one (plan_memory --serving sizes both).
      pools[blocks.CHUNKED] = blocks.BlockPool(
          num_blocks if num_chunked_blocks is None else num_chunked_blocks, block_size)
    self.names = list(pools)  # table index t of PagedKVCache = pool self.names[t]
    self.pool_sizes = [pools[n].num_blocks for n in self.names]  # per table, for the device
    manager = blocks.BlockManager if prefix_cache else _NoPrefixManager
    self.mgr = manager(pools, chunk_size=chunk if local else None, draft=draft)
    self.prompt_tokens = self.cached_tokens = 0  # over admitted requests: the prefix hit rate
    self.worst_case = worst_case
    self.chunk = chunk if local else None
    self.ahead = 1 + 2 * advance + slack
    self.slack, self.lag = slack, lag
    self.tables = np.full((slots, len(pools), self.max_blocks), kvc.NO_BLOCK, np.int32)
    self._worst: dict = {}  # rid -> {pool: blocks it may hold at once}
    self._limit: dict = {}  # rid -> highest position + 1 it may write

  # ----------------------------------------------------------------------------------------------
  def worst(self, prompt_len: int, max_tokens: int) -> dict[str, int]:
    """Blocks per pool a request may hold at once."""
    bs = self.block_size
    limit = min(prompt_len + max_tokens + self.slack, self.max_blocks * bs)
    out = {blocks.GLOBAL: -(-limit // bs)}
    if self.chunk is not None:
      window = -(-(self.chunk + self.ahead + self.lag) // bs) + 1
      first = -(-min(prompt_len + self.ahead, limit) // bs)
      out[blocks.CHUNKED] = min(out[blocks.GLOBAL], max(first, window))
    return out

  def _held(self, rid, name) -> int:
    return sum(b != kvc.NO_BLOCK for b in self.mgr.requests[rid].tables[name])

  def fits(self, prompt_len: int, max_tokens: int) -> bool:
    """Whether a new request's worst case fits beside every running request's, or without
    `worst_case` (the engine preempts when a pool runs dry) whether its prompt and first call do."""
    if not self.worst_case:
      need = -(-min(prompt_len + self.ahead, prompt_len + max_tokens + self.slack)
               // self.block_size)
      return all(need <= pool.available for pool in self.mgr.pools.values())
    new = self.worst(prompt_len, max_tokens)
    for name, pool in self.mgr.pools.items():
      owed = sum(max(w[name] - self._held(rid, name), 0) for rid, w in self._worst.items())
      if owed + new[name] > pool.available:
        return False
    return True

  def never_fits(self, prompt_len: int, max_tokens: int) -> str | None:
    """Why a request cannot run even on an idle engine, or None."""
    need = self.worst(prompt_len, max_tokens)
    for name, pool in self.mgr.pools.items():
      if need[name] > pool.num_blocks:
        flag = "num_blocks" if name == blocks.GLOBAL else "num_chunked_blocks"
        return (f"the request needs up to {need[name]} KV blocks of {self.block_size} tokens "
                f"but the {name} pool has {pool.num_blocks}: lower max_tokens, shorten the "
                f"prompt or raise {flag}")
    return None

  def admit(self, slot: int, rid, prompt, max_tokens: int, private: bool = False) -> int:
    """Allocates the prompt's blocks (and the first call's) and fills the slot's table. Returns
    the prompt tokens the prefix cache holds (the device prefills the rest). private: the
    request neither reuses nor publishes prefix blocks (its tokens do not say what its K/V are:
    an image prompt's placeholders)."""
    cached = self.mgr.admit(rid, prompt, private=private)
    self.prompt_tokens += len(prompt)
    self.cached_tokens += cached
    self._worst[rid] = self.worst(len(prompt), max_tokens)
    self._limit[rid] = min(len(prompt) + max_tokens + self.slack, self.max_blocks * self.block_size)
    self.reserve(slot, rid, len(prompt))
    return cached

  def reserve(self, slot: int, rid, known: int) -> None:
    """Blocks for every position the next call may write (`known`: the length the host has seen,
    prompt + tokens reported); releases chunk-local blocks no query can see; updates the table."""
    req = self.mgr.requests[rid]
    upto = min(known + self.ahead, self._limit[rid])
    self.mgr.release_invisible(rid)  # first: its blocks may serve the reservation
    self.mgr.reserve(rid, max(upto - len(req.tokens), 0))
    for t, name in enumerate(self.names):
      self.tables[slot, t] = self.mgr.table(rid, name, self.max_blocks)

  def commit(self, rid, tokens) -> None:
    """`tokens`: prompt + every token reported so far; commits all but the last `lag`."""
    if rid not in self.mgr.requests:
      return
    req = self.mgr.requests[rid]
    upto = len(tokens) - self.lag
    if upto > len(req.tokens):
      self.mgr.commit(rid, tokens[len(req.tokens):upto])

  def width(self, n: int) -> int:
    """The narrowest step-program table width holding every block slots [0, n) hold."""
    held = np.nonzero((self.tables[:n] != kvc.NO_BLOCK).any(axis=(0, 1)))[0]
    need = int(held[-1]) + 1 if held.size else 1
    return next(w for w in self.widths if w >= need)

  def move(self, src: int, dst: int) -> None:
    """The request in slot src now runs in slot dst (free): its table row goes along."""
    self.tables[dst] = self.tables[src]
    self.tables[src] = kvc.NO_BLOCK

  def free(self, slot: int | None, rid) -> None:
    """A finished or cancelled request lets go of its blocks (once)."""
    if rid in self.mgr.requests:
      self.mgr.release(rid)
      self._worst.pop(rid, None)
      self._limit.pop(rid, None)
    if slot is not None:
      self.tables[slot] = kvc.NO_BLOCK

  def stats(self) -> dict:
    pools = self.mgr.pools
    rate = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
    free = {f"{name}_blocks_free": p.available for name, p in pools.items()}
    used = {f"{name}_blocks_used": p.num_blocks - p.available for name, p in pools.items()}
    return {"prefix_hit_rate": rate, **free, **used}

  def idle(self) -> bool:
    """Every block free (or cached, unreferenced) and no request held."""
    return not self.mgr.requests and all(p.available == p.num_blocks and not np.any(p.refs)
                                         for p in self.mgr.pools.values())
