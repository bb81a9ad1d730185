"""maverick/serving/blocks.py: the paged-KV block allocator, checked against a simulated device
memory (every block slot holds the token id whose K/V a device would have written there), so a
shared block overwritten, a prefix hit on the wrong blocks, a missing fork copy or a freed block a
query still reads all show up as a wrong token at some position."""

import collections
import random

import numpy as np
import pytest

from maverick.serving import blocks as B

BS, CHUNK = 4, 16


class Device:
  """What the device would hold: pool -> block -> slot -> token id (None: never written)."""

  def __init__(self, mgr):
    self.mgr = mgr
    self.mem = {name: [[None] * BS for _ in range(p.num_blocks)] for name, p in mgr.pools.items()}

  def write(self, rid, start, tokens):
    for name in self.mgr.pools:
      table = self.mgr.requests[rid].tables[name]
      for i, t in enumerate(tokens):
        p = start + i
        self.mem[name][table[p // BS]][p % BS] = t

  def copy(self, copies):
    for name, src, dst in copies:
      self.mem[name][dst] = list(self.mem[name][src])

  def read(self, rid, name, positions):
    table = self.mgr.requests[rid].tables[name]
    return [self.mem[name][table[p // BS]][p % BS] for p in positions]


def _manager(n_global=24, n_chunked=14, rollback=0, draft=False):
  return B.BlockManager({B.GLOBAL: B.BlockPool(n_global, BS), B.CHUNKED: B.BlockPool(n_chunked, BS)},
                        chunk_size=CHUNK, rollback=rollback, draft=draft)


def _admit(mgr, dev, rid, prompt, slide=True):
  cached = mgr.admit(rid, prompt)
  dev.write(rid, cached, prompt[cached:])  # the prefill
  mgr.commit(rid, prompt[cached:])
  if slide:
    mgr.release_invisible(rid)
  return cached


def _holders(mgr):
  """pool -> Counter(block -> number of table entries holding it), from the tables alone."""
  out = {name: collections.Counter() for name in mgr.pools}
  for req in mgr.requests.values():
    for name, table in req.tables.items():
      out[name].update(b for b in table if b != B.NO_BLOCK)
  return out


def _check_invariants(mgr, dev, model):
  holders = _holders(mgr)
  for name, pool in mgr.pools.items():
    want = np.zeros(pool.num_blocks, np.int32)
    for b, n in holders[name].items():
      want[b] = n
    np.testing.assert_array_equal(pool.refs, want, err_msg=f"{name}: refs != tables holding")
    free, lru, held = set(pool.free), set(pool.lru), set(holders[name])
    assert len(free) == len(pool.free), f"{name}: a block twice on the free list"
    assert not free & held and not lru & held and not free & lru, name
    assert free | lru | held == set(range(pool.num_blocks)), f"{name}: a block lost"
    assert set(pool.key_of) >= lru, f"{name}: an uncached block on the LRU"
  for rid, (tokens, floor) in model.items():
    req = mgr.requests[rid]
    assert req.tokens == tokens and req.floor == floor
    assert dev.read(rid, B.GLOBAL, range(len(tokens))) == tokens, f"{rid}: global K/V wrong"
    # Everything a query at >= floor (any rollback included) reads on a chunk-local layer.
    lo = floor // CHUNK * CHUNK
    assert dev.read(rid, B.CHUNKED, range(lo, len(tokens))) == tokens[lo:], f"{rid}: chunked"


def _stamp_released(mgr, unheld_cached_before, stamps, step):
  """Stamps the cached blocks nobody holds now that somebody held before or during this op (by
  the tables; blocks taken and let go in one op share a stamp)."""
  after = _holders(mgr)
  for name, pool in mgr.pools.items():
    for b in set(pool.key_of) - set(after[name]) - unheld_cached_before[name]:
      stamps[name][b] = step


def _unheld_cached(mgr):
  held = _holders(mgr)
  return {name: set(p.key_of) - set(held[name]) for name, p in mgr.pools.items()}


def test_random_operations_against_a_simulated_device():
  """1,000 random admit (with shared prefixes) / extend (speculative window, partial accept) /
  rollback / fork / finish / cancel operations; after each: ref counts equal the tables holding a
  block, no block both free and held, every token a request can still read is the one it wrote,
  evictions only when the free list is empty and least-recently-released first."""
  rng = random.Random(0)
  R = 3
  mgr = _manager(rollback=R)
  dev = Device(mgr)
  model: dict[int, tuple[list[int], int]] = {}  # rid -> (committed tokens, floor)
  stamps = {name: {} for name in mgr.pools}
  docs = [[rng.randrange(1000) for _ in range(40)] for _ in range(3)]
  next_rid, counts = 0, collections.Counter()
  for step in range(1000):
    before = _holders(mgr)
    cached_before = {name: dict(p.key_of) for name, p in mgr.pools.items()}
    free_before = {name: len(p.free) for name, p in mgr.pools.items()}
    unheld_before = _unheld_cached(mgr)
    lru_before = {name: list(p.lru) for name, p in mgr.pools.items()}
    # Each op only takes blocks or only lets them go, so the eviction check below can count.
    op = rng.choice(["admit", "admit", "extend", "extend", "extend", "slide", "slide", "reserve",
                     "trim", "rollback", "fork", "finish", "cancel"])
    rids = sorted(model)
    try:
      if op == "admit" or not rids:
        op = "admit"
        doc = rng.choice(docs)
        prompt = doc[:rng.randrange(1, 40)] + [rng.randrange(1000)
                                               for _ in range(rng.randrange(0, 6))]
        cached = _admit(mgr, dev, next_rid, prompt, slide=False)
        assert cached % BS == 0 and cached < len(prompt)
        counts["hit"] += cached > 0
        model[next_rid] = (list(prompt), max(cached, len(prompt) - R))
        next_rid += 1
      elif op == "extend":
        rid = rng.choice(rids)
        tokens, floor = model[rid]
        window = rng.randrange(1, 6)  # K+1 verify positions written
        mgr.reserve(rid, window)
        drafted = [rng.randrange(1000) for _ in range(window)]
        dev.write(rid, len(tokens), drafted)
        accepted = drafted[:rng.randrange(1, window + 1)]
        mgr.commit(rid, accepted)
        tokens = tokens + accepted
        model[rid] = (tokens, max(floor, len(tokens) - R))
      elif op == "slide":
        counts["released"] += len(mgr.release_invisible(rng.choice(rids)))
      elif op == "reserve":  # a device call's window, nothing committed yet
        mgr.reserve(rng.choice(rids), rng.randrange(1, 6))
      elif op == "trim":
        mgr.trim(rng.choice(rids), rng.randrange(0, 3))
      elif op == "rollback":
        rid = rng.choice(rids)
        tokens, floor = model[rid]
        n = rng.randrange(0, len(tokens) - floor + 1)
        mgr.rollback_tokens(rid, n)
        model[rid] = (tokens[:len(tokens) - n], floor)
        counts["rollback"] += n > 0
      elif op == "fork":
        src = rng.choice(rids)
        dev.copy(mgr.fork(src, next_rid))
        model[next_rid] = (list(model[src][0]), model[src][1])
        next_rid += 1
      elif op == "finish":
        rid = rng.choice(rids)
        mgr.release(rid)
        del model[rid]
      else:  # cancel: like finish, also mid-call with blocks reserved for a window
        rid = rng.choice(rids)
        mgr.release(rid)
        del model[rid]
    except B.OutOfBlocks:
      counts["full"] += 1
      # All or nothing: a refused admit / fork / reserve leaves the request and the pools as
      # they were (LRU order included); the request of a refused extend goes on unchanged.
      assert next_rid not in mgr.requests
      assert {name: list(p.lru) for name, p in mgr.pools.items()} == lru_before
    counts[op] += 1
    _check_invariants(mgr, dev, model)
    for name, pool in mgr.pools.items():
      evicted = [b for b, k in cached_before[name].items() if pool.key_of.get(b) != k]
      if evicted:
        counts["evicted"] += len(evicted)
        allocated = sum((_holders(mgr)[name] - before[name]).values())
        assert len(evicted) <= allocated - free_before[name], f"{name}: evicted with free blocks"
        oldest_kept = min((stamps[name][b] for b in pool.lru), default=np.inf)
        assert max(stamps[name][b] for b in evicted) <= oldest_kept, f"{name}: LRU order"
    _stamp_released(mgr, unheld_before, stamps, step)
  for rid in list(model):
    mgr.release(rid)
  _check_invariants(mgr, dev, {})
  for pool in mgr.pools.values():
    assert pool.available == pool.num_blocks and not pool.refs.any()
  # The run exercised what it claims to.
  for what in ("hit", "released", "rollback", "fork", "cancel", "trim", "full", "evicted"):
    assert counts[what] >= 5, (what, counts)


def test_prefix_hit_shares_full_blocks_and_recomputes_the_last_token():
  mgr, doc = _manager(), list(range(100, 130))
  dev = Device(mgr)
  assert _admit(mgr, dev, "a", doc[:13]) == 0
  # Full blocks of a's prompt are cached: 3 of them (12 tokens).
  assert _admit(mgr, dev, "b", doc[:20]) == 12
  assert list(mgr.table("b")[:3]) == list(mgr.table("a")[:3])
  assert mgr.pools[B.GLOBAL].refs[mgr.table("a")[0]] == 2
  # A prompt that is exactly a's cached blocks keeps its last block to recompute the last token.
  assert mgr.admit("c", doc[:12]) == 8
  # A different first token: nothing shared (the key chains over the whole prefix).
  assert mgr.admit("d", [7] + doc[1:13]) == 0
  # A later block equal to a's but after a different prefix is not a hit either.
  assert mgr.admit("e", [7, 7, 7, 7] + doc[4:13]) == 0


def test_prefix_hit_with_a_draft_needs_the_token_after_each_block():
  """The draft's K/V at p are made from the token at p + 1: a cached block is a hit only where the
  token after it (final once committed past the block) is the new prompt's too."""
  mgr = _manager(draft=True)
  doc = list(range(200, 230))
  _admit(mgr, Device(mgr), "a", doc[:13])  # blocks 0-2 cached; their next tokens 204, 208, 212
  assert mgr.admit("b", doc[:20]) == 12  # all 3 blocks: the shared part goes on past them
  assert mgr.admit("c", doc[:12] + [999, 5, 6]) == 8  # block 2 was followed by 212, not 999
  # A block whose next token was not committed yet is no hit until it is.
  mgr = _manager(draft=True)
  _admit(mgr, Device(mgr), "a", doc[:12])  # block 2 cached, nothing after it committed
  assert len(mgr.prefix_hit(doc[:20])) == 2
  mgr.reserve("a", 1)
  mgr.commit("a", [doc[12]])
  assert len(mgr.prefix_hit(doc[:20])) == 3
  assert len(mgr.prefix_hit(doc[:12] + [999, 5])) == 2


def test_an_evicted_block_forgets_its_next_token():
  """A cached block taken back for another prompt is recorded anew with that prompt's next token."""
  mgr = B.BlockManager({B.GLOBAL: B.BlockPool(2, BS)}, draft=True)
  dev = Device(mgr)
  _admit(mgr, dev, "a", [1, 2, 3, 4, 5, 6])  # block 0 cached (next token 5), block 1 partial
  pool = mgr.pools[B.GLOBAL]
  root = mgr.table("a")[0]
  mgr.release("a")
  assert _admit(mgr, dev, "h", [30, 31]) == 0  # holds the free block: a's cached one is next
  c = [9, 9, 9, 9]
  assert _admit(mgr, dev, "c", c) == 0 and mgr.table("c")[0] == root  # evicted, reused
  mgr.release("h")
  mgr.reserve("c", 2)
  mgr.commit("c", [7, 8])  # c's block 0 is cached, and its next token 7 final
  assert pool.next_token[root] == 7 and len(mgr.prefix_hit(c + [7, 8])) == 1


def test_prefix_hit_with_a_draft_checks_interior_blocks_too():
  """A request that recomputed a block another request caches (different next token) caches the
  blocks after it: a later prompt matching those must not take the other request's block, whose
  draft K/V at its last position were made from another token."""
  mgr = _manager(draft=True)
  dev = Device(mgr)
  x = [1, 2, 3, 4]
  _admit(mgr, dev, "a", x + [50, 51, 52])  # block 0 cached, next token 50
  b = x + [60, 61, 62, 63, 64, 65]
  assert _admit(mgr, dev, "b", b) == 0  # 60 != 50: block 0 recomputed; its block 1 is cached
  assert mgr.prefix_hit(b + [70]) == []  # the old rule took a's block 0 here (one block short)


def test_cached_blocks_survive_release_until_evicted_lru_first():
  mgr = B.BlockManager({B.GLOBAL: B.BlockPool(6, BS)})
  dev = Device(mgr)
  a, b = list(range(9)), list(range(50, 59))
  _admit(mgr, dev, "a", a)  # blocks 0, 1 cached, 2 partial
  _admit(mgr, dev, "b", b)  # blocks 3, 4 cached, 5 partial
  mgr.release("a")
  mgr.release("b")  # LRU: a's (released first) before b's; each prefix's root last
  pool = mgr.pools[B.GLOBAL]
  assert list(pool.lru) == [1, 0, 4, 3] and sorted(pool.free) == [2, 5]
  # Needs 3 blocks: the 2 free ones, then the least recently released cached block (a's tail).
  _admit(mgr, dev, "c", list(range(500, 509)))
  assert 1 not in pool.key_of and list(pool.lru) == [0, 4, 3]
  assert len(mgr.prefix_hit(b)) == 2  # b's prefix is still cached
  assert len(mgr.prefix_hit(a)) == 1  # a's root block still is, its second block was evicted


def test_pool_exhaustion_is_all_or_nothing_with_a_clear_error():
  mgr = _manager(n_global=3, n_chunked=3)
  with pytest.raises(B.OutOfBlocks, match="admit fewer requests or size the pool larger"):
    mgr.admit("a", list(range(20)))  # 5 blocks
  assert not mgr.requests and mgr.pools[B.GLOBAL].available == 3
  with pytest.raises(ValueError, match="multiple of the block size"):
    B.BlockManager({B.GLOBAL: B.BlockPool(4, BS), B.CHUNKED: B.BlockPool(4, BS)}, chunk_size=6)
  m = _manager()
  m.admit("x", [1, 2, 3])
  with pytest.raises(ValueError, match="reserve them first"):
    m.commit("x", [1, 2, 3, 4, 5])
  with pytest.raises(ValueError, match="already admitted; release it first"):
    m.admit("x", [1])


@pytest.mark.parametrize("length,rollback,first", [
    (0, 0, 0), (15, 0, 0), (16, 0, 16), (17, 0, 16), (33, 0, 32),
    (17, 1, 16), (17, 2, 0), (32, 3, 16), (40, 40, 0), (40, 100, 0)])
def test_first_visible(length, rollback, first):
  """A query at q on a chunked layer reads [q // C * C, q]; the lowest future query is at
  length - rollback (speculative windows only go forward)."""
  assert B.first_visible(length, CHUNK, rollback) == first
  lowest = max(length - rollback, 0)
  assert first == min(q // CHUNK * CHUNK for q in range(lowest, lowest + 3 * CHUNK))


def test_chunk_local_release_keeps_the_rollback_window():
  """A verify window crossing a chunk boundary commits past it; the previous chunk is released
  only once no rollback can return into it."""
  R = 3
  mgr = _manager(rollback=R)
  dev = Device(mgr)
  rng = random.Random(1)
  prompt = [rng.randrange(1000) for _ in range(14)]
  _admit(mgr, dev, "a", prompt)
  mgr.reserve("a", 4)
  step = [rng.randrange(1000) for _ in range(4)]
  dev.write("a", 14, step)
  mgr.commit("a", step)  # length 18 crosses 16, but a rollback of 3 returns to 15: keep chunk 0
  assert mgr.release_invisible("a") == []
  mgr.rollback_tokens("a", 3)
  assert dev.read("a", B.CHUNKED, range(0, 15)) == prompt + step[:1]
  with pytest.raises(ValueError, match="cannot roll back 1 tokens, only 0"):
    mgr.rollback_tokens("a", 1)
  mgr.reserve("a", 4)
  more = [rng.randrange(1000) for _ in range(4)]
  dev.write("a", 15, more)
  mgr.commit("a", more)  # length 19, floor 16: chunk 0 (blocks 0-3) can go
  chunk0 = list(mgr.table("a", B.CHUNKED)[:4])
  assert sorted(mgr.release_invisible("a")) == sorted(chunk0)
  assert list(mgr.table("a", B.CHUNKED)[:4]) == [B.NO_BLOCK] * 4
  assert list(mgr.table("a")[:4]) == chunk0 or mgr.table("a")[0] != B.NO_BLOCK  # global keeps all
  assert B.NO_BLOCK not in mgr.table("a")
  # A new request reusing this prefix takes the global blocks and only the chunked ones it reads.
  assert mgr.admit("b", prompt + step[:1] + more + [5]) == 16
  assert list(mgr.table("b", B.CHUNKED)[:4]) == [B.NO_BLOCK] * 4


def test_fork_shares_cached_blocks_and_copies_the_rest():
  mgr = _manager()
  dev = Device(mgr)
  prompt = list(range(300, 310))  # 2 full blocks + 2 tokens
  _admit(mgr, dev, "a", prompt)
  copies = mgr.fork("a", "b")
  ta, tb = mgr.table("a"), mgr.table("b")
  assert list(tb[:2]) == list(ta[:2]) and tb[2] != ta[2]
  assert (B.GLOBAL, ta[2], tb[2]) in copies and len(copies) == 2  # global + chunked
  dev.copy(copies)
  mgr.reserve("b", 1)
  dev.write("b", 10, [1])
  mgr.commit("b", [1])
  assert dev.read("a", B.GLOBAL, range(10)) == prompt  # b's write went to its own copy


def test_prefill_in_pieces_holds_at_most_a_chunk_on_chunk_local_layers():
  """A prompt of 3.5 chunks prefilled one chunk at a time: the chunked pool never holds more than
  one chunk's blocks (the memory plan's paged + chunk-local count assumes this)."""
  mgr = _manager(n_global=20, n_chunked=CHUNK // BS)
  dev = Device(mgr)
  prompt = list(range(1000, 1000 + 3 * CHUNK + CHUNK // 2))
  assert mgr.admit("a", prompt, prefill=CHUNK) == 0
  done = 0
  while done < len(prompt):
    piece = prompt[done:done + CHUNK]
    dev.write("a", done, piece)
    mgr.commit("a", piece)
    done += len(piece)
    mgr.release_invisible("a")
    if done < len(prompt):
      mgr.reserve("a", min(CHUNK, len(prompt) - done))
  assert dev.read("a", B.GLOBAL, range(len(prompt))) == prompt
  lo = len(prompt) // CHUNK * CHUNK
  assert dev.read("a", B.CHUNKED, range(lo, len(prompt))) == prompt[lo:]
  with pytest.raises(B.OutOfBlocks):  # the whole prompt at once does not fit the chunked pool
    mgr.admit("b", [1] + prompt, prefill=None)
  with pytest.raises(ValueError, match="prefill must be >= 1"):
    mgr.admit("c", prompt, prefill=0)


def test_trim_and_padded_tables():
  mgr = _manager()
  _admit(mgr, Device(mgr), "a", list(range(6)))  # 2 blocks
  pool = mgr.pools[B.GLOBAL]
  mgr.reserve("a", 10)  # positions < 16: 4 blocks
  assert pool.available == pool.num_blocks - 4
  mgr.trim("a", 3)  # keep positions < 9: 3 blocks
  assert pool.available == pool.num_blocks - 3 and len(mgr.table("a")) == 3
  mgr.trim("a")
  t = mgr.table("a", width=5)
  assert t.dtype == np.int32 and list(t[2:]) == [B.NO_BLOCK] * 3 and B.NO_BLOCK not in t[:2]
  with pytest.raises(ValueError, match="past width 1"):
    mgr.table("a", width=1)


def test_a_private_request_neither_reuses_nor_publishes_prefix_blocks():
  """admit(private=True) (an image prompt: its tokens do not determine its K/V): no prefix hit on
  the same tokens, and its committed blocks are never served to a later request."""
  mgr = B.BlockManager({B.GLOBAL: B.BlockPool(16, BS)})
  prompt = list(range(1, 3 * BS + 2))
  assert mgr.admit("text", prompt) == 0
  mgr.commit("text", prompt)
  assert mgr.admit("image", prompt, private=True) == 0  # the text's blocks are cached, not used
  mgr.commit("image", prompt)
  mgr.release("text")
  mgr.release("image")
  other = [p + 1000 for p in prompt]
  assert mgr.admit("image2", other, private=True) == 0
  mgr.commit("image2", other)
  mgr.release("image2")
  assert mgr.admit("later", other) == 0  # nothing of image2 was published
  assert mgr.admit("again", prompt) == 3 * BS  # the text request's blocks still are
