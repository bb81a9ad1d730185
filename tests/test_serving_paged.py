"""Engine(kv_layout="paged"): token-for-token the contiguous engine's output (plain decoding,
EAGLE-3 chains K = 1..5, a tree; bf16 and FP8 KV) with prompts + outputs past 3 chunks of the
embedded model (chunk 128) and more requests than slots; the host bookkeeping (maverick/serving/
paging.py) leaves every block free once idle after random requests and cancellations."""

import os
import random
import threading
import time

import numpy as np
import pytest

import maverick
import spec_decode
from maverick.quant import config as quant_config
from maverick.quant import convert
from maverick.serving import Engine, blocks, paging
from spec_decode.tree import TreeShape
from test_serving_engine import WAIT_S, _assert_on_device, _run, _wait_idle

BS = 32  # blocks per 128-token chunk: 4


@pytest.fixture(scope="module")
def loaded():
  return maverick.load("tiny")


@pytest.fixture(scope="module")
def tiny_draft(loaded):
  return spec_decode.load_draft("tiny", loaded.model)


def _prompts(loaded):
  """Python source from the training domain (drafts get accepted), the longest past 3 chunks."""
  tok = loaded.tokenizer
  text = open(maverick.__file__.replace("__init__.py", "generation.py")).read()
  ids = tok.encode(text)
  assert len(ids) > 800
  # 370 + 40: decoding crosses the chunk boundary at 384 (and block boundaries on the way)
  return [ids[:370], ids[400:650], ids[100:220]], [40, 30, 30]


def _engines(model, draft, layout_kw, **kw):
  """The engine with one prompt bucket and one batch bucket (few compiles), capacity a whole
  number of blocks, so both layouts run attention over the same shapes."""
  slack = 1 if draft is None else (kw["tree"].cache_slack if "tree" in kw else kw["k"] + 1)
  max_seq_len = 512 - slack
  return Engine(model, draft, slots=2, max_seq_len=max_seq_len, rounds=4, min_bucket=512,
                batch_buckets=[2], stop_tokens=[], **layout_kw, **kw)


SETTINGS = [("plain", None, {})] + [(f"k{k}", "bf16", dict(k=k)) for k in range(1, 6)] + [
    ("tree", "bf16", dict(tree=TreeShape(3, 2, 5)))]


def _compare(model, draft, prompts, max_tokens, **kw):
  outs, engines = {}, {}
  for layout in ("contiguous", "paged"):
    layout_kw = {} if layout == "contiguous" else dict(kv_layout="paged", block_size=BS)
    e = _engines(model, draft, layout_kw, **kw)
    e.compile()
    e.start()
    try:
      outs[layout] = _run(e, prompts, max_tokens)
    finally:
      e.shutdown()
    engines[layout] = e
  assert outs["paged"] == outs["contiguous"]
  paged = engines["paged"]
  assert paged.capacity == engines["contiguous"].capacity and paged.capacity % BS == 0
  assert paged._paging.idle()  # every block back once idle
  assert max(len(p) + n for p, n in zip(prompts, max_tokens)) > 3 * 128
  return paged


@pytest.mark.slow
@pytest.mark.parametrize("name,draft_kind,kw", SETTINGS, ids=[s[0] for s in SETTINGS])
def test_paged_engine_equals_contiguous(loaded, tiny_draft, name, draft_kind, kw):
  prompts, max_tokens = _prompts(loaded)
  draft = None if draft_kind is None else tiny_draft
  paged = _compare(loaded.model, draft, prompts, max_tokens, **kw)
  _assert_on_device(paged)
  if draft is not None:
    assert paged.spec_accepted > paged.spec_rounds  # drafts were accepted: multi-token advances


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["plain", "k3", "tree"])
def test_paged_engine_fp8_kv_equals_contiguous(loaded, spec):
  """Dynamic FP8 KV: the paged insert prefills through the start= path (attending to the cache)
  and the contiguous one into an empty cache; both read the prompt's K/V as stored (e4m3 with
  the per-token scales on scores and probabilities), so the outputs agree token for token,
  near-ties included (a chain, K = 3, and a tree)."""
  model = convert.quantize_model(loaded.model, quant_config.QuantConfig(weights=None,
                                                                        kv_cache="fp8"))
  prompts, max_tokens = _prompts(loaded)
  kw = {"plain": {}, "k3": dict(k=3), "tree": dict(tree=TreeShape(3, 2, 5))}[spec]
  draft = None if spec == "plain" else spec_decode.load_draft("tiny", model)
  paged = _compare(model, draft, prompts, max_tokens, **kw)
  cache = paged._slots_state["cache"]
  assert cache.quantized and cache.k[0].shape[1] == BS


PREFIX = [("plain", None, {}), ("k3", "bf16", dict(k=3)),
          ("tree", "bf16", dict(tree=TreeShape(3, 2, 5)))]


@pytest.mark.slow
@pytest.mark.parametrize("name,draft_kind,kw", PREFIX, ids=[s[0] for s in PREFIX])
def test_prefix_cache_hits_skip_the_shared_prefill_and_keep_the_output(loaded, tiny_draft, name,
                                                                        draft_kind, kw):
  """Requests sharing a 300-token prefix (past 2 chunks) one after another, then again: every
  output equals the contiguous engine's; the later ones hit the cache (their prefill starts at
  the hit, in a smaller prompt bucket), with a draft too (the token after the last shared block
  is shared as well, so the draft's K/V there are the same)."""
  ids, _ = _prompts(loaded)
  shared = ids[0][:300]
  tails = [[7, 8, 9], ids[1][:40], [11] * 5, ids[2][:20]]
  prompts = [shared + t for t in tails]
  draft = None if draft_kind is None else tiny_draft
  outs = {}
  for layout in ("contiguous", "paged"):
    layout_kw = {} if layout == "contiguous" else dict(kv_layout="paged", block_size=BS,
                                                      prefix_cache=True)
    e = Engine(loaded.model, draft, slots=2, max_seq_len=512 - (1 if draft is None else 6),
               rounds=4, min_bucket=64, batch_buckets=[2], stop_tokens=[], **layout_kw, **kw)
    e.compile()
    buckets = []
    for b in e.buckets:
      exe = e._exes[b]
      e._exes[b] = lambda *a, exe=exe, b=b: buckets.append(b) or exe(*a)
    e.start()
    try:
      outs[layout] = [_run(e, [p], [24])[0] for p in prompts + prompts[:1]]
    finally:
      e.shutdown()
  assert outs["paged"] == outs["contiguous"]
  pg = e._paging
  hit = 288  # whole blocks of the shared 300
  assert pg.cached_tokens == hit * len(prompts)  # every request after the first
  # Prefills only from the hit on: the first in the whole prompt's bucket, later ones in smaller.
  assert buckets == [e.bucket(len(p) - (hit if i else 0))
                     for i, p in enumerate(prompts + prompts[:1])]
  assert max(buckets[1:]) < buckets[0]
  assert e.kv_stats()["prefix_hit_rate"] > 0.5 and pg.idle()


@pytest.mark.slow
def test_paged_engine_small_pool_random_cancellations_frees_every_block(loaded, tiny_draft):
  """24 requests of random lengths on a pool a third of the contiguous size (requests wait for
  blocks), a third of them cancelled at random points from their callbacks: the others' outputs
  equal a contiguous engine's, and once idle every block is free and every table empty."""
  rng = random.Random(1)
  ids, _ = _prompts(loaded)
  reqs = [(ids[0][rng.randrange(100):][:rng.randint(5, 200)], rng.randint(1, 40),
           rng.random() < 0.33, rng.randint(0, 3)) for _ in range(24)]
  kw = dict(slots=3, max_seq_len=251, rounds=2, min_bucket=256, batch_buckets=[3],
            stop_tokens=[], k=2)
  ref = Engine(loaded.model, tiny_draft, **kw)
  ref.compile()
  ref.start()
  try:
    want = _run(ref, [r[0] for r in reqs if not r[2]], [r[1] for r in reqs if not r[2]])
  finally:
    ref.shutdown()
  e = Engine(loaded.model, tiny_draft, kv_layout="paged", block_size=BS,
             num_blocks=ref.slots * 8 // 3, prefix_cache=True, **kw)
  e.compile()
  e.start()
  got, done = {}, threading.Event()
  left = [len(reqs)]
  lock = threading.Lock()
  handles = {}  # a callback may run before submit returns: it cancels once its handle is here

  def finish():
    with lock:
      left[0] -= 1
      if not left[0]:
        done.set()
  try:
    for i, (prompt, n, cancel, after) in enumerate(reqs):
      got[i] = []
      def on_event(ev, i=i, cancel=cancel, after=after):
        got[i].extend(ev.tokens)
        if cancel and not ev.done and len(got[i]) >= after and i in handles:
          e.cancel(handles[i])
          finish()
        elif ev.done:
          finish()
      handles[i] = e.submit(prompt, on_event, max_tokens=n)
    assert done.wait(WAIT_S) and e.error is None
    _wait_idle(e)
  finally:
    e.shutdown()
  assert [got[i] for i, r in enumerate(reqs) if not r[2]] == want
  assert e.released > 0 and e._paging.idle() and np.all(e._paging.tables == blocks.NO_BLOCK)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["plain", "k2"])
def test_preemption_when_the_pool_runs_dry_keeps_the_output(loaded, spec):
  """Three requests that fit the pool when admitted but not once they have grown: the youngest is
  preempted (its blocks freed, requeued, its prompt + tokens so far recomputed later), and every
  output, greedy and seeded sampling (plain decoding), equals the contiguous engine's. float32
  weights: a recompute is a prefill where the unpreempted run decoded, and in bf16 their logits
  differ by enough to flip a sampled near-tie (seen once in CI under load, where the preemption
  point moved); in float32 that noise is far below any top-2 gap."""
  ids, _ = _prompts(loaded)
  loaded = maverick.load("tiny", dtype="float32")
  prompts = [ids[0][:100], ids[1][:110], ids[2][:90], ids[0][200:230]]
  sampled = spec == "plain"
  options = [dict(temperature=0.9, seed=5) if sampled else {}, {},
             dict(temperature=0.7, top_p=0.9, seed=11) if sampled else {}, {}]
  max_tokens = [120, 110, 130, 40]
  draft = spec_decode.load_draft("tiny", loaded.model) if spec == "k2" else None
  kw = dict(slots=3, max_seq_len=251, rounds=2, min_bucket=256, batch_buckets=[3],
            stop_tokens=[], **(dict(k=2) if draft else {}))
  outs = {}
  for layout in ("contiguous", "paged"):
    layout_kw = {} if layout == "contiguous" else dict(kv_layout="paged", block_size=BS,
                                                      num_blocks=13, preemption=True)
    e = Engine(loaded.model, draft, **layout_kw, **kw)
    e.compile()
    e.start()
    try:
      outs[layout] = _run(e, prompts, max_tokens, options)
    finally:
      e.shutdown()
  assert outs["paged"] == outs["contiguous"]
  assert [len(o) for o in outs["paged"]] == max_tokens
  assert e.preemptions > 0 and e.kv_stats()["preemptions"] == e.preemptions
  time.sleep(0.5)
  assert e._paging.idle()


# ------------------------------------------------------------------------------------------------
# Host bookkeeping without a device
# ------------------------------------------------------------------------------------------------
REQUESTS = 1000


def test_paged_kv_host_bookkeeping_random_requests_and_cancellations(loaded):
  """A simulated engine loop (lagging reports, reserve ahead, chunk-local release, random
  cancellations, admission by blocks) over 1,000 random requests on a small pool: reservations
  never fail, every position a call may write is reserved, no chunk-local block a query can see
  is released, and every block is free at the end: the host bookkeeping the engine uses
  (paging.PagedKV), checked at every call. The real engine runs 1,000 random requests with
  cancellations in test_thousand_random_requests_with_cancellations_leave_every_block_free
  (slow, below)."""
  cfg = loaded.model.config
  slots, capacity, advance, slack, lag = 4, 512, 9, 3, 4
  pg = paging.PagedKV(cfg, slots, capacity, block_size=BS, num_blocks=40, advance=advance,
                      slack=slack, lag=lag, draft=True)
  assert pg.layer_table == tuple(int(cfg.is_chunked(i)) for i in range(cfg.num_hidden_layers))
  rng = random.Random(0)
  owner = [None] * slots
  waiting = []
  admitted = finished = cancelled = 0
  rid = 0
  step = 0
  while rid < REQUESTS or waiting or any(owner):
    step += 1
    assert step < 20 * REQUESTS, "admission stalled: blocks never came back"
    if rid < REQUESTS and rng.random() < 0.5 and len(waiting) < 6:
      n = rng.randint(1, 300)
      waiting.append(dict(id=rid, prompt=[rng.randrange(4096) for _ in range(n)],
                          max_tokens=rng.randint(1, 511 - slack - n), out=[], dev=n))
      rid += 1
    for b, r in enumerate(owner):
      if r is not None and rng.random() < 0.03:  # cancelled
        pg.free(b, r["id"])
        owner[b] = None
        cancelled += 1
    for b in range(slots):
      if owner[b] is None and waiting:
        r = waiting[0]
        assert pg.never_fits(len(r["prompt"]), r["max_tokens"]) is None
        if not pg.fits(len(r["prompt"]), r["max_tokens"]):
          break
        waiting.pop(0)
        pg.admit(b, r["id"], r["prompt"], r["max_tokens"])
        owner[b] = r
        admitted += 1
    for b, r in enumerate(owner):  # before the call: reserve from what the host has seen
      if r is not None:
        pg.reserve(b, r["id"], len(r["prompt"]) + len(r["out"]))
    for b, r in enumerate(owner):  # the call: writes up to `advance` tokens + slack past dev
      if r is None:
        continue
      limit = len(r["prompt"]) + r["max_tokens"]
      new = min(rng.randint(1, advance), limit - r["dev"])
      top = r["dev"] + new + slack  # positions dev .. top-1 written
      table = pg.tables[b]
      for p in range(r["dev"], top):
        assert table[0, p // BS] != blocks.NO_BLOCK, (step, b, p)
        assert table[1, p // BS] != blocks.NO_BLOCK, (step, b, p)
      lo = (r["dev"] // 128) * 128  # every query of the call sees from its chunk's start
      assert all(table[1, j] != blocks.NO_BLOCK for j in range(lo // BS, r["dev"] // BS + 1))
      r["dev"] += new
      r.setdefault("flight", []).append([rng.randrange(4096) for _ in range(new)])
    for b, r in enumerate(owner):  # a call's report is read after the next call is dispatched
      if r is None or len(r["flight"]) < 2:
        continue
      r["out"] += r["flight"].pop(0)
      pg.commit(r["id"], r["prompt"] + r["out"])
      if len(r["out"]) >= r["max_tokens"] or rng.random() < 0.02:
        pg.free(b, r["id"])
        owner[b] = None
        finished += 1
  assert admitted == REQUESTS and cancelled > 300 and finished > 400, (cancelled, finished)
  assert pg.idle() and np.all(pg.tables == blocks.NO_BLOCK)


def test_paged_engine_bad_arguments_and_oversized_requests(loaded):
  with pytest.raises(ValueError, match="kv_layout must be 'contiguous' or 'paged'"):
    Engine(loaded.model, kv_layout="pages")
  with pytest.raises(ValueError, match="pass kv_layout='paged'"):
    Engine(loaded.model, num_blocks=8)
  with pytest.raises(ValueError, match="num_blocks >= 1"):
    Engine(loaded.model, kv_layout="paged", num_blocks=0)
  assert Engine(loaded.model, slots=2, max_seq_len=256).kv_stats() == {"kv_layout": "contiguous"}
  e = Engine(loaded.model, slots=2, max_seq_len=256, kv_layout="paged", num_blocks=3,
             block_size=BS)
  assert e.kv_stats() == {"kv_layout": "paged", "block_size": BS, "preemptions": 0,
                          "prefix_hit_rate": 0.0,
                          "global_blocks_free": 3,
                          "chunked_blocks_free": 3, "global_blocks_used": 0,
                          "chunked_blocks_used": 0}
  with pytest.raises(maverick.serving.RequestError, match="needs up to 6 KV blocks of 32 tokens "
                     "but the global pool has 3: .*raise num_blocks"):
    e.submit([1] * 100, lambda ev: None, max_tokens=60)
  # A chunk-local pool smaller than the global one: a prompt prefills whole, so it must fit.
  e = Engine(loaded.model, slots=2, max_seq_len=256, kv_layout="paged", num_blocks=16,
             num_chunked_blocks=3, block_size=BS)
  assert (e.kv_stats()["global_blocks_free"], e.kv_stats()["chunked_blocks_free"]) == (16, 3)
  with pytest.raises(maverick.serving.RequestError, match="needs up to 4 KV blocks of 32 tokens "
                     "but the chunked pool has 3: .*raise num_chunked_blocks"):
    e.submit([1] * 100, lambda ev: None, max_tokens=10)
  with pytest.raises(ValueError, match="num_chunked_blocks sizes the chunk-local layers' pool, but "
                     "this engine has none .*chunk_local=False"):
    Engine(loaded.model, slots=2, max_seq_len=256, kv_layout="paged", chunk_local=False,
           num_chunked_blocks=8)
  with pytest.raises(ValueError, match="num_chunked_blocks.* need the paged KV layout"):
    Engine(loaded.model, slots=2, max_seq_len=256, num_chunked_blocks=8)
  with pytest.raises(ValueError, match="num_chunked_blocks=0"):
    Engine(loaded.model, slots=2, max_seq_len=256, kv_layout="paged", num_chunked_blocks=0)



def _peak_blocks(pg, prompt_len, max_tokens, advance):
  """Most blocks per pool one request's table names at once, driven as engine.py's _loop drives
  it: reserve from the known length, dispatch a call that adds `advance` tokens (the most one
  call adds), then read the PREVIOUS call's report and commit it (lagging). Counted in the table
  the device gets, not in the allocator's books."""
  prompt = [(7 * i) % 4096 + 1 for i in range(prompt_len)]
  held = lambda: {n: int(np.sum(pg.tables[0, t] != blocks.NO_BLOCK))
                  for t, n in enumerate(pg.names)}
  pg.admit(0, "r", prompt, max_tokens)
  peak = held()
  out, flight, dev = [], [], prompt_len
  while len(out) < max_tokens:
    pg.reserve(0, "r", prompt_len + len(out))
    peak = {n: max(peak[n], b) for n, b in held().items()}
    new = min(advance, prompt_len + max_tokens - dev)
    dev += new
    flight.append([5] * new)
    if len(flight) == 2:  # the call before this one reports now
      out += flight.pop(0)
      pg.commit("r", prompt + out)
  pg.free(0, "r")
  assert pg.idle()
  return peak


# (advance, slack, lag) as Engine sets them (window, slack, width + 2): plain decoding with
# rounds=4; K=3 with rounds=4; TreeShape(3, 2, 5) (width 3, cache_slack 7) with rounds=4.
ENGINE_WINDOWS = [(5, 1, 2), (17, 4, 5), (17, 7, 5)]


@pytest.mark.parametrize("advance,slack,lag", ENGINE_WINDOWS)
def test_admission_counts_cover_the_chunk_window(loaded, advance, slack, lag):
  """Admission's worst case per request (PagedKV.worst: what `fits` holds back for it) is at
  least the most blocks the request's table ever names, on both pools, for prompts ending at
  offsets all around the chunk boundaries and a decode across the next one at the most tokens
  per call, with the host's reports one call behind. On the chunked pool the peak is the chunk
  window: the current chunk plus the positions reserved ahead (two calls + a round's slack) plus
  the commit lag, past the chunk's own blocks; an admission count one block short of the peak
  lets a running request's reservation fail (an engine without preemption stops on
  OutOfBlocks). The window count keeps one block to spare: the peak is at most
  ceil((chunk - 1 + ahead + lag) / block), so dropping its `+ 1` still passes here, while a count
  short of the peak (or without the ahead span, or the lag at a small block) fails. Host
  bookkeeping only: no model call."""
  cfg = loaded.model.config
  chunk, capacity = cfg.attention_chunk_size, 512
  assert chunk == 128
  for bs in (BS, 2):  # 2: the commit lag spans blocks past the spare one
    gap = {blocks.GLOBAL: [], blocks.CHUNKED: []}
    peak_chunked = 0
    for p in sorted(set(range(1, 400, 9)) | {chunk - 1, chunk, chunk + 1, 2 * chunk + 3}):
      pg = paging.PagedKV(cfg, 1, capacity, block_size=bs, num_blocks=2 * capacity // bs,
                          advance=advance, slack=slack, lag=lag, draft=True)
      max_tokens = capacity - slack - p
      peak = _peak_blocks(pg, p, max_tokens, advance)
      worst = pg.worst(p, max_tokens)
      for name in gap:
        assert peak[name] <= worst[name], (bs, name, p, peak, worst)
        gap[name].append(worst[name] - peak[name])
      if p < chunk // 2:  # the decode, not the prompt, sets the chunked peak
        peak_chunked = max(peak_chunked, peak[blocks.CHUNKED])
    assert min(gap[blocks.GLOBAL]) == 0  # met exactly: the global count is no looser than needed
    assert peak_chunked > chunk // bs  # the window spans more than the chunk's blocks


@pytest.mark.slow
@pytest.mark.parametrize("k", [None, 3])
def test_sharded_paged_engine_equals_contiguous(loaded, k):
  """On a mesh of the 8 CPU devices (layout ep: expert=4 x tensor=2) the paged engine's greedy
  output equals the contiguous engine's, plain and K=3, and every block pool is laid out as the
  sharding plan says for KV heads (over the tensor axis)."""
  from maverick import sharding
  mesh = sharding.make_mesh(expert=4, tensor=2)
  sharded = maverick.load("tiny", mesh=mesh, layout="ep")
  draft = None if k is None else sharding.shard_model(
      spec_decode.load_draft("tiny", sharded.model), mesh, "ep")
  ids, _ = _prompts(loaded)
  prompts, max_tokens = [ids[0][:40], ids[1][:20], ids[2][:30]], [30, 12, 20]
  outs = {}
  for layout in ("contiguous", "paged"):
    layout_kw = {} if layout == "contiguous" else dict(kv_layout="paged", block_size=16)
    e = Engine(sharded.model, draft, slots=2, max_seq_len=128 - (1 if k is None else k + 1),
               rounds=2, min_bucket=128, batch_buckets=[2], stop_tokens=[], **layout_kw,
               **({} if k is None else dict(k=k)))
    e.compile()
    e.start()
    try:
      outs[layout] = _run(e, prompts, max_tokens)
    finally:
      e.shutdown()
    assert e.error is None
  assert outs["paged"] == outs["contiguous"]
  assert all(len(o) == n for o, n in zip(outs["paged"], max_tokens))
  cache = e._slots_state["cache"]
  heads = loaded.model.config.num_key_value_heads
  for pool in cache.k + cache.v:
    axis = pool.shape.index(heads)  # [blocks, block_size, kv heads, head_dim]
    assert pool.sharding.spec[axis] == "tensor", pool.sharding.spec
  assert e._paging.idle()


def test_chunk_local_off_releases_no_block_and_keeps_the_output(loaded):
  """Engine(chunk_local=False): the chunk-local layers page as global ones (one pool), no table
  ever has a hole (a released block before a held one), and the output equals the chunk-local
  engine's, which does release blocks before the chunk (one prompt past a chunk, plain decoding)."""
  ids, _ = _prompts(loaded)
  prompts, max_tokens = [ids[0][:200], ids[1][:60]], [40, 20]
  outs, holes = {}, {}
  for local in (True, False):
    e = Engine(loaded.model, None, slots=2, max_seq_len=255, rounds=4, min_bucket=256,
               batch_buckets=[2], stop_tokens=[], kv_layout="paged", block_size=BS,
               chunk_local=local)
    seen = []
    reserve = e._paging.reserve

    def spy(slot, rid, known, reserve=reserve, e=e, seen=seen):
      reserve(slot, rid, known)
      seen.append(e._paging.tables[slot].copy())
    e._paging.reserve = spy
    e.compile()
    e.start()
    try:
      outs[local] = _run(e, prompts, max_tokens)
    finally:
      e.shutdown()
    # A hole: NO_BLOCK at an entry with a held block after it.
    holes[local] = sum(bool(np.any((t[:-1] == blocks.NO_BLOCK) & (t[1:] != blocks.NO_BLOCK)))
                       for table in seen for t in table)
    assert e.peak_active == 2
    pools = e._paging.names
    assert pools == ([blocks.GLOBAL, blocks.CHUNKED] if local else [blocks.GLOBAL])
    assert any(e._paging.layer_table) == local
  assert outs[False] == outs[True]
  assert holes[True] > 0 and holes[False] == 0


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["plain", "k3"])
def test_a_small_chunk_local_pool_keeps_the_output(loaded, tiny_draft, spec):
  """Engine(num_chunked_blocks=16): the chunk-local layers' pools hold 16 blocks (one row's
  worth) beside a global pool of 32, so the 370- and 250-token prompts cannot hold their chunked
  blocks at once and the second waits for blocks, not a slot. The output equals the contiguous
  engine's, past 3 chunks, and no table ever names more chunked blocks than the pool has."""
  prompts, max_tokens = _prompts(loaded)
  kw = {} if spec == "plain" else dict(k=3)
  draft = None if spec == "plain" else tiny_draft
  outs = {}
  for layout_kw in ({}, dict(kv_layout="paged", block_size=BS, num_chunked_blocks=16)):
    e = _engines(loaded.model, draft, layout_kw, **kw)
    held = []
    if layout_kw:
      pg = e._paging
      assert pg.pool_sizes == [2 * pg.max_blocks, 16]
      reserve = pg.reserve

      def spy(slot, rid, known, reserve=reserve, pg=pg):
        reserve(slot, rid, known)
        held.append(int(np.sum(pg.tables[:, 1] != blocks.NO_BLOCK)))
      pg.reserve = spy
    e.compile()
    e.start()
    try:
      outs[bool(layout_kw)] = _run(e, prompts, max_tokens)
    finally:
      e.shutdown()
  assert outs[True] == outs[False]
  assert max(held) <= 16 and e.peak_active == 2
  cache = e._slots_state["cache"]
  sizes = {(e._paging.layer_table[i], x.shape[0]) for i, x in enumerate(cache.k)}
  assert sizes == {(0, 2 * e._paging.max_blocks), (1, 16)}  # (table, pool blocks) per layer
  time.sleep(0.5)
  assert e._paging.idle()


def test_chunk_local_off_without_the_paged_layout_is_refused(loaded):
  with pytest.raises(ValueError, match="chunk_local=False need the paged KV layout: pass "
                     "kv_layout='paged'"):
    Engine(loaded.model, None, slots=2, max_seq_len=64, chunk_local=False)


# ------------------------------------------------------------------------------------------------
# Churn: the whole engine
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_thousand_random_requests_with_cancellations_leave_every_block_free(loaded, tiny_draft):
  """The real paged engine (device programs, host loop) through 1,000 random requests with random
  cancellations on a small pool: speculative K=2, prefix cache, preemption, chunk-local release,
  narrower table widths and slot compaction all at once. Once idle, every block is free and every
  table empty (issue 29's acceptance; the host bookkeeping alone is stress-tested above)."""
  draft = tiny_draft
  ids = loaded.tokenizer.encode(open(maverick.__file__.replace("__init__.py",
                                                               "generation.py")).read())
  rng = random.Random(0)
  # Shared system prompts (prefix hits, past a 128-token chunk) or none, then a random tail.
  systems = [ids[0:70], ids[300:440], ids[600:640], []]
  reqs = []
  for _ in range(REQUESTS):
    start = rng.randrange(len(ids) - 100)
    prompt = (rng.choice(systems) + ids[start:start + rng.randint(1, 60)])[:200]
    # (prompt, max_tokens, cancelled?, after how many tokens: 0 = right after submit)
    reqs.append((prompt, rng.randint(1, 40), rng.random() < 0.3, rng.randint(0, 6)))
  e = Engine(loaded.model, draft, k=2, slots=4, max_seq_len=245, rounds=2, min_bucket=64,
             batch_buckets=[1, 2, 4], stop_tokens=[], kv_layout="paged", block_size=32,
             num_blocks=20, prefix_cache=True, preemption=True, table_widths=(4,))
  e.compile()
  narrow = []  # calls of a step program over 4-block tables (of 8)
  for key in [key for key in e._exes if isinstance(key, tuple) and key[2:] == (4,)]:
    exe = e._exes[key]
    e._exes[key] = lambda *a, exe=exe: narrow.append(1) or exe(*a)
  got = {i: [] for i in range(REQUESTS)}
  ended, handles = {}, {}
  lock, all_ended = threading.RLock(), threading.Event()

  def end(i, how):
    with lock:
      if i not in ended:
        ended[i] = how
        if len(ended) == REQUESTS:
          all_ended.set()

  e.start()
  try:
    for i, (prompt, n, cancel, after) in enumerate(reqs):
      def on_event(ev, i=i, cancel=cancel, after=after):
        got[i].extend(ev.tokens)
        if ev.done:
          end(i, ev.finish_reason)
        elif cancel and len(got[i]) >= after and i in handles:
          e.cancel(handles[i])
          end(i, "cancelled")
      with lock:  # a callback may run before submit returns: it cancels once its handle is here
        handles[i] = e.submit(prompt, on_event, max_tokens=n)
      if cancel and after == 0:
        e.cancel(handles[i])
        end(i, "cancelled")
    assert all_ended.wait(float(os.environ.get("MAVERICK_CHURN_WAIT_S", 900))), (
        f"{REQUESTS - len(ended)} requests never ended")
    _wait_idle(e)
  finally:
    e.shutdown()
  assert e.error is None, e.error
  done = [i for i in range(REQUESTS) if ended[i] != "cancelled"]
  assert all(ended[i] == "length" and len(got[i]) == reqs[i][1] for i in done)
  cancelled = REQUESTS - len(done)
  assert cancelled > 200 and e.released > 100, (cancelled, e.released)
  # Prefix hits and narrow tables ran; preemptions (3-4 seen) and moves (0-2) depend on timing.
  assert e.kv_stats()["prefix_hit_rate"] > 0.1, e.kv_stats()
  print(f"preemptions {e.preemptions}, moves {e.moves}, cancelled {cancelled}, "
        f"narrow calls {len(narrow)} of {e.steps}")
  assert narrow and len(narrow) < e.steps
  assert e._paging.idle() and np.all(e._paging.tables == blocks.NO_BLOCK), e.kv_stats()
