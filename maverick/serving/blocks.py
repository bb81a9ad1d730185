"""Host-side paged KV bookkeeping (issue 29): fixed-size blocks, per-request block tables,
reference counts, prefix caching, and early release on chunk-local layers. Pure Python/NumPy: the
serving engine's paged layout (maverick/serving/paging.py) keeps its tables here and sends them to
the device (kv_cache.PagedKVCache: a block-table scatter / gather around the attention).

Block size. DEFAULT_BLOCK_SIZE = 64 is the decode attention kernel's KV tile
(pallas_kernels/decode_attention/plan.py BLOCK_KV, which api.py walks in whole tiles): one block is
one TMA tile of K (and one of V) per KV head, so a paged kernel fetches a block per pipeline stage
with no tile straddling two blocks, and the per-tile position / chunk masks stay unchanged. Llama 4's
chunk (8192) is a multiple of it, so a chunk boundary never falls inside a block.

Pools. A block id names storage for a group of layers at `block_size` positions. Two pools:
- "global": the NoPE full-attention layers (12 of Maverick's 48) plus the EAGLE-3 draft's one layer
  (global causal attention at the same positions as the target; a pool view: its storage is one more
  layer per block, so target and draft share one table and one allocator).
- "chunked": the RoPE chunk-local layers (36 of 48). Their blocks before the current chunk are
  released while the request runs (`release_invisible`), which a shared id across all 48 layers
  could not do: a global layer still needs the same positions.
Prefix caching works per pool with one hash chain (the same tokens give the same hash in both); a
prefix hit counts only where both pools still hold what the new request will read.

Prefix caching. A block is cached once it is full of committed tokens (the device wrote their K/V)
that no rollback can take back: its key is SHA-256 of (parent key, its token ids), so equal keys
mean equal whole prefixes. A cached block
whose last holder releases it goes to an LRU list instead of the free list; `allocate` takes free
blocks first and evicts the least recently released cached block only when none is free. A hit never
covers the whole prompt (the last prompt token is recomputed for its logits). With a draft
(`draft=True`) the key is not enough: the draft's K/V at position p is made from the token at p + 1
(EAGLE-3 pairs the target's features at p with the next token), so the draft K/V at a block's last
position depends on the token after the block. The global pool (where the draft layer lives)
records that token for each cached block once it is final (committed past the block), and a block
is a hit only if the new prompt has the same token there: a prompt sharing 600 tokens reuses all 9
full 64-token blocks. A cached block whose next token is not final yet is no hit with a draft.

Writes go only into blocks past every shared one: shared blocks are cached ones, and a fork copies
the source's blocks past its cached ones (`fork` returns the copies to make on device).

Speculative windows. A round writes past the committed length (K+1 verify positions, or a tree's
slots, `TreeShape.cache_slack`) into blocks `reserve` added; every query of the round is at or past
the committed length, and rejected drafts roll back to no lower, so chunk-local release by the
committed length (less `rollback`) never frees a block a round or its rollback reads.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Hashable, Sequence

import numpy as np

DEFAULT_BLOCK_SIZE = 64  # pallas_kernels/decode_attention/plan.py BLOCK_KV (see above)
NO_BLOCK = -1  # a table entry whose block was released (before the chunk a chunked layer sees)
GLOBAL, CHUNKED = "global", "chunked"


class OutOfBlocks(RuntimeError):
  """The pool has no free and no evictable block: admit fewer requests or give the pool more."""


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
  """Prefix-cache key of a full block: SHA-256 of its parent's key (b"" at the root) and its token
  ids (stable across processes, unlike hash(); a collision would silently mix two prompts)."""
  return hashlib.sha256(parent + np.asarray(tokens, np.int64).tobytes()).digest()


def first_visible(length: int, chunk_size: int, rollback: int = 0) -> int:
  """First position any future query of a request can attend to on a chunk-local layer.

  `length`: committed tokens (the device wrote their K/V; the next query is at `length`).
  Speculative rounds write a window past `length` (K+1 verify positions, or tree slots), and their
  queries all lie at >= length, so the window never reaches back before `length`'s chunk; rejected
  drafts roll back to >= length. `rollback`: how far below `length` a later rollback may still go
  (tokens counted as committed before they were verified); the chunk of `length - rollback` is kept.
  """
  if chunk_size < 1 or length < 0 or rollback < 0:
    raise ValueError(f"first_visible needs chunk_size >= 1, length >= 0, rollback >= 0; got "
                     f"{chunk_size}, {length}, {rollback}")
  lowest = max(length - rollback, 0)
  return lowest // chunk_size * chunk_size


def visible_blocks(length: int, chunk_size: int, block_size: int, rollback: int = 0) -> int:
  """Index of the first block a chunk-local layer still needs; blocks before it can be released."""
  return first_visible(length, chunk_size, rollback) // block_size


class BlockPool:
  """`num_blocks` physical blocks: reference counts, a free list, and the prefix cache (key ->
  block, with an LRU over cached blocks nobody holds)."""

  def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
    if num_blocks < 1 or block_size < 1:
      raise ValueError(f"a pool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                       f"{block_size}")
    self.num_blocks, self.block_size = num_blocks, block_size
    self.refs = np.zeros(num_blocks, np.int32)
    self.free = collections.deque(range(num_blocks))
    self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
    self.key_of: dict[int, bytes] = {}  # cached block -> key
    self.block_of: dict[bytes, int] = {}  # key -> cached block
    # cached block -> the token after it when its last position's draft K/V was written (see
    # the module docstring; set once, by the request that wrote the block)
    self.next_token: dict[int, int] = {}

  @property
  def available(self) -> int:
    """Blocks `allocate` can hand out: free plus evictable."""
    return len(self.free) + len(self.lru)

  def allocate(self) -> int:
    if self.free:
      b = self.free.popleft()
    elif self.lru:
      b, _ = self.lru.popitem(last=False)  # least recently released
      del self.block_of[self.key_of.pop(b)]
      self.next_token.pop(b, None)
    else:
      raise OutOfBlocks(f"all {self.num_blocks} blocks are held by running requests: admit fewer "
                        "requests or size the pool larger")
    self.refs[b] = 1
    return b

  def incref(self, b: int) -> None:
    if self.refs[b] == 0:
      self.lru.pop(b)  # only cached blocks are taken back from nobody
    self.refs[b] += 1

  def decref(self, b: int) -> None:
    if self.refs[b] <= 0:
      raise AssertionError(f"block {b} released more often than it was taken")
    self.refs[b] -= 1
    if self.refs[b] == 0:
      if b in self.key_of:
        self.lru[b] = None  # newest at the end
      else:
        self.free.append(b)

  def cache(self, b: int, key: bytes) -> None:
    """Registers full block `b` under `key` (a block already cached under `key` wins)."""
    if key not in self.block_of and b not in self.key_of:
      self.block_of[key], self.key_of[b] = b, key

  def lookup(self, key: bytes) -> int | None:
    return self.block_of.get(key)


@dataclasses.dataclass
class Request:
  tokens: list[int]  # committed tokens (their K/V is written)
  keys: list[bytes]  # prefix-cache key of each full block below `floor`
  tables: dict[str, list[int]]  # pool name -> block ids (NO_BLOCK where released)
  floor: int = 0  # lowest length a rollback may return to (never decreases)
  private: bool = False  # never shares its blocks through the prefix cache (see admit)
  followed: int = 0  # with a draft: blocks below this have their next token recorded (or had)


class BlockManager:
  """Block tables of running requests over the "global" and (optional) "chunked" pools.

  Lifecycle: `admit(rid, prompt)` -> (cached tokens; the device prefills the rest) ->
  `reserve(rid, n)` before each device call (room for n writes past the committed length: the
  call's decode / verify window) -> `commit(rid, tokens)` after it (the tokens whose K/V the device
  kept) -> `release_invisible(rid)` (chunked pool) -> `release(rid)` when finished or cancelled.
  `fork(src, dst)` starts a request sharing everything `src` has committed (n > 1 completions).

  `rollback`: how many committed tokens `rollback(rid, n)` may take back (0 when only verified
  tokens are committed, as in the engine). Each request keeps a floor = its highest committed
  length minus `rollback`; nothing below the floor can be taken back, so only blocks below it are
  cached (shared blocks are never written again) and chunk-local release keeps the floor's chunk.
  """

  def __init__(self, pools: dict[str, BlockPool], *, chunk_size: int | None = None,
               draft: bool = False, rollback: int = 0):
    if GLOBAL not in pools or set(pools) - {GLOBAL, CHUNKED}:
      raise ValueError(f"pools must be {{'global'[, 'chunked']}}, got {sorted(pools)}")
    sizes = {p.block_size for p in pools.values()}
    if len(sizes) != 1:
      raise ValueError(f"pools must share one block size, got {sorted(sizes)}")
    self.block_size = sizes.pop()
    if (CHUNKED in pools) != (chunk_size is not None):
      raise ValueError("a 'chunked' pool needs chunk_size, and chunk_size needs a 'chunked' pool")
    if chunk_size is not None and (chunk_size < 1 or chunk_size % self.block_size):
      raise ValueError(f"chunk_size {chunk_size} must be a positive multiple of the block size "
                       f"{self.block_size}, so no block straddles a chunk boundary")
    if rollback < 0:
      raise ValueError(f"rollback must be >= 0, got {rollback}")
    self.pools, self.chunk_size, self.draft, self.rollback = pools, chunk_size, draft, rollback
    self.requests: dict[Hashable, Request] = {}

  def _first_needed(self, name: str, floor: int) -> int:
    """First block of pool `name` a request whose rollback floor is `floor` can still read."""
    if name == CHUNKED:
      return visible_blocks(floor, self.chunk_size, self.block_size)
    return 0

  def prefix_hit(self, prompt: Sequence[int]) -> list[bytes]:
    """Keys of the prompt's cached leading blocks a new request may reuse (see module docstring)."""
    bs = self.block_size
    keys, parent, pool = [], b"", self.pools[GLOBAL]
    for j in range((len(prompt) - 1) // bs):  # the last prompt token is always recomputed
      parent = block_key(parent, prompt[j * bs:(j + 1) * bs])
      b = pool.lookup(parent)
      if b is None:
        break
      # the draft's K/V at the block's last position were made from the token after it
      if self.draft and pool.next_token.get(b) != int(prompt[(j + 1) * bs]):
        break
      keys.append(parent)
    while keys:  # the other pools must hold the blocks the new request will read
      if all(self.pools[name].lookup(k) is not None for name in self.pools if name != GLOBAL
             for k in keys[self._first_needed(name, len(keys) * bs):]):
        break
      keys.pop()
    return keys

  def admit(self, rid, prompt: Sequence[int], *, prefill: int | None = None,
            private: bool = False) -> int:
    """Starts request `rid`: reuses cached prefix blocks, allocates blocks for the rest of the
    prompt, or for its next `prefill` tokens (a long prompt prefilled in pieces, each followed by
    `commit` / `release_invisible` / `reserve`, never holds more than a chunk on chunk-local
    layers). Returns the number of cached tokens (the device prefills prompt[cached:]).
    private: no prefix hit and none of its blocks cached (a prompt whose K/V the token ids do not
    determine, e.g. one with images: every image has the same placeholder tokens)."""
    if prefill is not None and prefill < 1:
      raise ValueError(f"prefill must be >= 1 tokens, got {prefill}")
    if rid in self.requests:
      raise ValueError(f"request {rid!r} is already admitted; release it first")
    if len(prompt) < 1:
      raise ValueError("admit needs a prompt of at least one token")
    keys = [] if private else self.prefix_hit(prompt)
    cached = len(keys) * self.block_size
    hits = {name: [pool.lookup(k) for k in keys[self._first_needed(name, cached):]]
            for name, pool in self.pools.items()}
    todo = len(prompt) - len(keys) * self.block_size
    todo = todo if prefill is None else min(todo, prefill)
    new = -(-(len(keys) * self.block_size + todo) // self.block_size) - len(keys)
    # Checked before anything is taken, so a refusal leaves the pools (and LRU order) untouched.
    short = [name for name, pool in self.pools.items()
             if new > pool.available - sum(pool.refs[b] == 0 for b in hits[name])]
    if short:
      raise OutOfBlocks(f"request {rid!r} needs {new} new blocks; pool(s) {short} cannot give "
                        "them: admit fewer requests or size the pool larger")
    req = Request(list(prompt[:cached]), keys, {}, floor=cached, private=private)
    for name, pool in self.pools.items():
      req.tables[name] = [NO_BLOCK] * (len(keys) - len(hits[name]))
      for b in hits[name]:
        pool.incref(b)
        req.tables[name].append(b)
    self.requests[rid] = req
    self.reserve(rid, todo)
    return cached

  def reserve(self, rid, n: int) -> None:
    """Blocks for positions < committed + n (the next writes); all or nothing."""
    req = self.requests[rid]
    need = -(-(len(req.tokens) + n) // self.block_size)
    missing = {name: max(need - len(t), 0) for name, t in req.tables.items()}
    short = [name for name, m in missing.items() if m > self.pools[name].available]
    if short:
      raise OutOfBlocks(f"request {rid!r} needs {missing} more blocks; pool(s) {short} cannot "
                        "give them: admit fewer requests or size the pool larger")
    for name, m in missing.items():
      req.tables[name].extend(self.pools[name].allocate() for _ in range(m))

  def commit(self, rid, tokens: Sequence[int]) -> None:
    """The device wrote K/V of `tokens` at the committed length onward: raises the floor and
    caches the blocks now wholly below it."""
    req = self.requests[rid]
    start, bs = len(req.tokens), self.block_size
    if -(-(start + len(tokens)) // bs) > len(req.tables[GLOBAL]):
      raise ValueError(f"request {rid!r}: committing {len(tokens)} tokens at {start} runs past its "
                       f"{len(req.tables[GLOBAL])} blocks; reserve them first")
    req.tokens.extend(int(t) for t in tokens)
    req.floor = max(req.floor, len(req.tokens) - self.rollback)
    for j in range(len(req.keys), 0 if req.private else req.floor // bs):
      req.keys.append(block_key(req.keys[-1] if req.keys else b"", req.tokens[j * bs:(j + 1) * bs]))
      for name, pool in self.pools.items():
        if req.tables[name][j] != NO_BLOCK:
          pool.cache(req.tables[name][j], req.keys[j])
    if self.draft:  # a block's next token, once final (below the floor): see prefix_hit
      pool = self.pools[GLOBAL]
      while req.followed < len(req.keys) and (req.followed + 1) * bs < req.floor:
        b = req.tables[GLOBAL][req.followed]
        if pool.key_of.get(b) == req.keys[req.followed]:
          pool.next_token.setdefault(b, req.tokens[(req.followed + 1) * bs])
        req.followed += 1

  def rollback_tokens(self, rid, n: int) -> None:
    """Takes back the last `n` committed tokens (rejected after all); their blocks stay reserved."""
    req = self.requests[rid]
    if not 0 <= n <= len(req.tokens) - req.floor:
      raise ValueError(f"request {rid!r}: cannot roll back {n} tokens, only "
                       f"{len(req.tokens) - req.floor} (rollback window {self.rollback})")
    del req.tokens[len(req.tokens) - n:]

  def release_invisible(self, rid) -> list[int]:
    """Releases the chunked-layer blocks no future query of `rid` can see; returns them."""
    if CHUNKED not in self.pools:
      return []
    req = self.requests[rid]
    table, pool, out = req.tables[CHUNKED], self.pools[CHUNKED], []
    for j in range(min(self._first_needed(CHUNKED, req.floor), len(table))):
      if table[j] != NO_BLOCK:
        out.append(table[j])
        pool.decref(table[j])
        table[j] = NO_BLOCK
    return out

  def trim(self, rid, n: int = 0) -> None:
    """Releases reserved blocks past committed + n (e.g. after a cancelled or shorter call)."""
    req = self.requests[rid]
    need = -(-(len(req.tokens) + n) // self.block_size)
    for name, table in req.tables.items():
      while len(table) > need:
        b = table.pop()
        if b != NO_BLOCK:
          self.pools[name].decref(b)

  def fork(self, src, dst) -> list[tuple[str, int, int]]:
    """Starts `dst` with everything `src` has committed: the cached (full, below-floor) blocks
    shared, the rest copied. Returns (pool, src block, dst block) copies the device makes first."""
    if dst in self.requests:
      raise ValueError(f"request {dst!r} is already admitted; release it first")
    s = self.requests[src]
    shared = len(s.keys)
    n = -(-len(s.tokens) // self.block_size)
    if any(self.pools[name].available < n - shared for name in self.pools):
      raise OutOfBlocks(f"fork of {src!r}: no room to copy its {n - shared} unshared blocks")
    req = Request(list(s.tokens), list(s.keys), {}, floor=s.floor, private=s.private,
                  followed=s.followed)
    copies = []
    for name, pool in self.pools.items():
      table = list(s.tables[name][:shared])
      for b in table:
        if b != NO_BLOCK:
          pool.incref(b)
      for j in range(shared, n):
        b = pool.allocate()
        table.append(b)
        copies.append((name, s.tables[name][j], b))
      req.tables[name] = table
    self.requests[dst] = req
    return copies

  def release(self, rid) -> None:
    """Finished or cancelled: every block is let go (cached ones stay reusable until evicted)."""
    req = self.requests.pop(rid)
    for name, table in req.tables.items():
      for b in reversed(table):  # a prefix's root is released last, so it is evicted last
        if b != NO_BLOCK:
          self.pools[name].decref(b)

  def table(self, rid, name: str = GLOBAL, width: int | None = None) -> np.ndarray:
    """The request's block table for pool `name`, padded with NO_BLOCK to `width`."""
    t = self.requests[rid].tables[name]
    width = len(t) if width is None else width
    if width < len(t):
      raise ValueError(f"table of {rid!r} has {len(t)} blocks, past width {width}")
    return np.array(t + [NO_BLOCK] * (width - len(t)), np.int32)
