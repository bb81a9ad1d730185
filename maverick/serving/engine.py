"""Continuous-batching engine: a fixed set of slots, one jitted device call per engine step.

The batch is `slots` rows of a preallocated KV cache (and draft cache for speculative decoding).
Every per-request value lives in device arrays with a batch axis (cache rows, lengths, last token,
sampling parameters, stop ids, token limit, output buffer, done flag), so admitting a request or
changing its parameters never recompiles:

  - `insert` (jitted, one program per prompt-length bucket) prefills one bucketed prompt into a
    fresh one-row cache, samples its first token (and, speculative, prefills the draft and drafts
    the first candidates) and writes that row into slot `slot` of the state (a traced index);
  - `step` (jitted, one program per batch bucket n) runs up to `rounds` decode steps or
    speculative rounds for the first n slots in a `lax.while_loop` that leaves as soon as a slot
    finishes, and returns the tokens each slot produced since the last step (a [n, W] window) with
    counts and done flags. Requests take the lowest free slot and n is the smallest bucket holding
    every busy slot, so one user costs a batch-1 step, not a `slots`-row one (as a GPU server pads
    to its captured batch sizes).

The loop bodies are `maverick.generation.decode_round` and `spec_decode.speculative.round_fns`,
the same code `maverick.generate` and `spec_decode.generate` run. Free slots are rows marked done:
they compute (fixed shapes) but commit nothing.

The host loop (a background thread) dispatches step t+1 before it reads step t's results, so the
device always has the next call queued; between calls it admits waiting requests into free slots
and releases cancelled ones (a traced mask of the next step). Nothing inside a call goes back to
the host.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import queue
import threading
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from maverick import generation as plain
from maverick import kernels as kernels_lib
from maverick import kv_cache as kvc
from maverick import sampling
from maverick import sharding
from maverick.serving import blocks
from maverick.serving import compaction as compaction_lib
from maverick.serving import images as images_lib
from maverick.serving import paging
from spec_decode import speculative as spec

DEFAULT_ROUNDS = 8
LOGPROB_FIELDS = ("logprob", "top_ids", "top_logprobs")  # of sampling.Output, reported per step


class RequestError(ValueError):
  """A request `submit` refuses; param names the request field at fault ("prompt", "max_tokens",
  ...) and code is OpenAI's error code where it has one."""

  def __init__(self, message: str, param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.param, self.code = param, code


@dataclasses.dataclass
class Event:
  """What the engine reports for one request after a step: its new tokens (possibly none)."""
  tokens: list[int]
  done: bool
  finish_reason: str | None = None  # "stop" (a stop token) or "length" when done
  time: float = 0.0  # time.perf_counter() when the host read the step's results
  rounds: int = 0  # speculative: verify rounds so far
  accepted: int = 0  # speculative: tokens committed by those rounds
  # With logprobs=N: per token of `tokens`, (its logprob, [(token id, logprob)] of the N most
  # likely), under the distribution it was sampled from (see docs/concepts/generation.md, Sampling).
  logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
  # With prompt_logprobs=True, on the first event: None for the first prompt token, then as
  # `logprobs` for each prompt token after it (the model's raw distribution).
  prompt_logprobs: list | None = None


@dataclasses.dataclass(eq=False)
class Handle:
  """A submitted request. `callback(event)` runs on the engine thread."""
  id: int
  prompt: list[int]
  max_tokens: int
  stop_ids: frozenset
  callback: Callable[[Event], None]
  params: sampling.SamplingParams
  stop_row: np.ndarray
  logprobs: int | None = None
  prompt_logprobs: bool = False
  prompt_result: list | None = None  # computed at admission, sent with the first event
  submitted: float = 0.0
  admitted: float | None = None
  num_tokens: int = 0
  finished: bool = False
  cancelled: bool = False
  output: list = dataclasses.field(default_factory=list)  # tokens reported so far
  pixels: np.ndarray | None = None  # the request's image tiles (see maverick/serving/images.py)


class Engine:
  """Serves token-id requests from a background thread; see the module docstring.

  model: a maverick Llama4 (sharded or not); draft: an EAGLE-3 draft for speculative rounds
  (k draft tokens per round, or tree drafting with `tree`), None for plain decoding.
  slots: the batch. max_seq_len: prompt + generated tokens per slot (the cache rows hold that plus
  a speculative round's slack). rounds: decode steps / speculative rounds per device call at most.
  kv_layout: "contiguous" (each slot a row of the cache) or "paged" (KV blocks of `block_size`
  positions from pools of `num_blocks` blocks shared by all slots, default slots x the blocks of a
  row, so no more memory than contiguous; admission by free blocks, chunk-local layers release
  blocks their queries can no longer see, from a pool of `num_chunked_blocks` (default
  num_blocks); see maverick/serving/paging.py). prefix_cache (paged):
  full blocks of committed tokens are kept (LRU) and shared by later prompts that start with the
  same tokens, whose prefill then starts after them (prefills attend to the cache: the programs
  differ from the no-prefix-cache engine's). chunk_local=False (paged): chunk-local layers keep all
  their blocks, as global ones do (one pool; for comparison, see benchmarks/serving_kv.py).
  table_widths (paged): block-table widths (blocks per row) to compile step programs for besides
  the whole row; each call runs the narrowest that holds every block its rows reserved, so the
  XLA path gathers and attends over the longest running row, not max_seq_len (more programs to
  compile: batch buckets x widths). compaction: move a request left alone in a high slot down
  (serving/compaction.py); None: on for the CPU backend, off on a GPU where it has not run yet.
  """

  def __init__(self, model, draft=None, *, k: int = 3, tree=None, slots: int = 8,
               max_seq_len: int = 512, rounds: int = DEFAULT_ROUNDS,
               stop_tokens: Sequence[int] | None = None, max_stop_ids: int = 8,
               pad_id: int | None = None, min_bucket: int = plain.MIN_BUCKET,
               batch_buckets: Sequence[int] | None = None,
               max_logit_bias: int = sampling.MAX_LOGIT_BIAS, kv_layout: str = "contiguous",
               num_blocks: int | None = None, block_size: int = blocks.DEFAULT_BLOCK_SIZE,
               prefix_cache: bool = False, preemption: bool = False, chunk_local: bool = True,
               table_widths: Sequence[int] = (), num_chunked_blocks: int | None = None,
               compaction: bool | None = None):
    cfg = model.config
    if kv_layout not in ("contiguous", "paged"):
      raise ValueError(f"kv_layout must be 'contiguous' or 'paged', got {kv_layout!r}")
    if (num_blocks is not None or num_chunked_blocks is not None or prefix_cache or preemption
        or not chunk_local or table_widths) and kv_layout != "paged":
      raise ValueError("num_blocks, num_chunked_blocks, prefix_cache, preemption, table_widths "
                       "and chunk_local=False need the paged KV layout: pass kv_layout='paged' "
                       "with them")
    self.prefix_cache, self.preemption = bool(prefix_cache), bool(preemption)
    if slots < 1 or rounds < 1:
      raise ValueError(f"slots and rounds must be >= 1, got slots={slots}, rounds={rounds}")
    if not 2 <= max_seq_len <= cfg.max_position_embeddings:
      raise ValueError(f"max_seq_len must be in [2, {cfg.max_position_embeddings}] (the model's "
                       f"context), got {max_seq_len}")
    self.model, self.draft, self.config = model, draft, cfg
    self.tree = tree
    if draft is None:
      self.k, self.width, slack = 0, 0, 1
    elif tree is not None:
      tree.check_draft_vocab(draft.config.draft_vocab_size)
      self.k, self.width, slack = None, tree.depth, tree.cache_slack
    else:
      draft.config.check_target(cfg)
      self.k, self.width, slack = int(k), int(k), int(k) + 1
    self.slots, self.max_seq_len, self.rounds = slots, max_seq_len, rounds
    self.capacity = kernels_lib.cache_capacity(max_seq_len + slack, model,
                                               *([draft] if draft is not None else []))
    self.pad_id = plain.resolve_pad_id(cfg, pad_id)
    self.default_stop = list(cfg.eos_token_ids if stop_tokens is None else stop_tokens)
    self.max_stop_ids = max(max_stop_ids, len(self.default_stop))
    self.max_logit_bias = max(1, int(max_logit_bias))  # logit_bias entries per request
    self.window = rounds * (self.width + 1) + 1  # tokens a slot can produce in one step (+ insert)
    self._paging = None
    if kv_layout == "paged":
      per_row = -(-self.capacity // block_size)
      self._paging = paging.PagedKV(
          cfg, slots, self.capacity, block_size=block_size,
          num_blocks=slots * per_row if num_blocks is None else num_blocks,
          advance=self.window, slack=slack, lag=self.width + 2, draft=draft is not None,
          prefix_cache=prefix_cache, worst_case=not preemption, chunk_local=chunk_local,
          widths=table_widths, num_chunked_blocks=num_chunked_blocks)
    self.buckets = []
    b = min_bucket
    while b < max_seq_len:
      self.buckets.append(b)
      b *= 2
    self.buckets.append(max_seq_len)
    if batch_buckets is None:
      batch_buckets = [1 << i for i in range(slots.bit_length()) if 1 << i < slots]
    self.batch_buckets = sorted({int(n) for n in batch_buckets if 1 <= int(n) < slots} | {slots})
    self.plan = sharding.plan_of(model)
    self._graphdefs, self._states = [], []
    for m in (model,) + ((draft,) if draft is not None else ()):
      g, s = nnx.split(m)
      self._graphdefs.append(g)
      self._states.append(s)
    self._graphdefs = tuple(self._graphdefs)
    self._exes: dict = {}
    self._slots_state = None
    self._owner: list[Handle | None] = [None] * slots
    self._waiting: queue.SimpleQueue = queue.SimpleQueue()
    self._head: Handle | None = None  # taken from _waiting, waiting for KV blocks (paged)
    self._preempted: collections.deque = collections.deque()  # youngest first (paged)
    self.preemptions = 0
    self._wake = threading.Event()
    self._ids = itertools.count()
    self._thread: threading.Thread | None = None
    self._stop = False
    self.error: BaseException | None = None
    self._failure = threading.Lock()  # orders `error` being set against submit's queueing
    self.steps = 0  # device steps dispatched
    self.steps_by_batch = {n: 0 for n in self.batch_buckets}  # ... per batch bucket run
    self.released = 0  # slots freed by a cancellation (a client gone, a stop string)
    self.finished = 0  # requests that ran to a stop token or their limit
    self.peak_active = 0  # most requests running at once (benchmarks/serving_kv.py)
    self.compaction = compaction_lib.enabled(compaction)
    self.moves = 0  # rows moved to a lower slot (serving/compaction.py)
    self.spec_rounds = self.spec_accepted = 0  # over finished requests: acceptance length

  # ---------------------------------------------------------------------------------------------
  # Device programs
  # ---------------------------------------------------------------------------------------------
  def _models(self, states):
    models = [nnx.merge(g, s) for g, s in zip(self._graphdefs, states)]
    return models[0], (models[1] if len(models) > 1 else None)

  def _is_row(self, path) -> bool:
    """Whether a leaf of the slot state has one row per slot: all but a chain's parents [K],
    which are the same for every request, and a paged cache's block pools (shared by all)."""
    if (self._paging is not None and len(path) > 1
        and getattr(path[0], "key", None) in ("cache", "dcache")
        and getattr(path[1], "name", None) in ("k", "v", "k_scale", "v_scale")):
      return False
    return self.tree is not None or not any(getattr(p, "name", None) == "parents" for p in path)

  def _paged_rows(self, rows, tables):
    """rows' paged caches with lengths 0 and these tables [n, P, M] (a fresh row to prefill),
    as (cache, dcache); (None, None) for a contiguous cache."""
    if self._paging is None:
      return None, None
    fresh = lambda c, t: c.with_tables(t).with_lengths(jnp.zeros((t.shape[0],), jnp.int32))
    return (fresh(rows["cache"], tables),
            fresh(rows["dcache"], tables[:, :1]) if "dcache" in rows else None)

  def _empty_paged(self):
    """One-row paged caches (target, draft) of the engine's pools, all blocks zero."""
    pg = self._paging
    init = lambda cfg, sizes, **kw: kvc.PagedKVCache.init(cfg, 1, sizes, pg.max_blocks,
                                                          pg.block_size, **kw)
    cache = init(self.config, pg.pool_sizes, layer_table=pg.layer_table)
    # The draft layer pages as a global layer: table 0 only.
    dcache = (None if self.draft is None
              else init(self.draft.config.layer, pg.pool_sizes[0], num_layers=1))
    return cache, dcache

  def _map_rows(self, fn, rows, *rest):
    """fn over the per-slot leaves; other leaves come from the last tree given."""
    return jax.tree_util.tree_map_with_path(
        lambda path, *xs: fn(*xs) if self._is_row(path) else xs[-1], rows, *rest)

  def _constrain(self, rows: dict) -> dict:
    """Pins every leaf of the slot state to one sharding (caches as generate's, other per-slot
    leaves split over the batch axes, the rest replicated): the init, insert and step programs are
    compiled ahead of time for those input shardings, so their outputs must come back in them."""
    rows = dict(rows)
    caches = {"cache": rows.pop("cache")}
    caches["cache"] = sharding.constrain_cache(caches["cache"], self.plan)
    if "dcache" in rows:
      caches["dcache"] = sharding.constrain_cache(rows.pop("dcache"), sharding.plan_of(self.draft))
    if self.plan is not None:
      mesh = self.plan.mesh

      def pin(path, x):
        spec = (PartitionSpec(self.plan.batch_axis(x.shape[0])) if x.ndim and self._is_row(path)
                else PartitionSpec())
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
      rows = jax.tree_util.tree_map_with_path(pin, rows)
    return dict(rows, **caches)

  def _new_row(self, states, prompt, length, params, stop_ids, max_tokens, cache=None,
               dcache=None, suffix=None, start=None, prior=None, num_prior=None,
               prompt_length=None, pixels=None):
    """One request's row (batch 1): prefill, first token, (draft prefill and candidates). The
    row's random stream is its own (params.seed): no key is shared between slots. cache, dcache:
    paged one-row caches to prefill into (the pools of every slot, this row's tables). With the
    paged cache: `prompt` is the whole prompt of `prompt_length` (the repetition penalty's marks),
    `prior` the first `num_prior` tokens the request produced before it was preempted (the row
    starts with them: token indices, random streams and penalty counts go on as if it had never
    stopped), `length` = prompt_length + num_prior and `suffix` those tokens from `start` [1] on,
    the part to prefill (the blocks before are shared prefix-cache blocks)."""
    target, draft = self._models(states)
    req = plain.Request(prompt=prompt, prompt_lengths=length if prompt_length is None
                        else prompt_length, max_new_tokens=max_tokens, stop_ids=stop_ids,
                        sampling=params, pixel_values=pixels)
    cols = self.max_seq_len + self.window
    result = plain.init_output(self.config, req, 1, cols - (self.width + 1), self.width + 1,
                               self.pad_id)
    stop = lambda out, new, n, lp: sampling.append(out, new, n, stop_ids, max_tokens,
                                                   self.pad_id, lp)
    row = dict(params=params, stop_ids=stop_ids, max_tokens=max_tokens,
               emitted=jnp.zeros((1,), jnp.int32))
    if suffix is not None:
      result = sampling.append(result, prior, num_prior, stop_ids, max_tokens, self.pad_id)
      row["emitted"] = num_prior
      req = dataclasses.replace(req, prompt=suffix, prompt_lengths=length)
    if draft is None:
      out, cache = plain.prefill(target, req, self.capacity, cache=cache, start=start)
      token, logprobs = sampling.sample(out.logits, params, result, stop_ids)
      result = stop(result, token[:, None], jnp.ones((1,), jnp.int32), logprobs)
      return dict(row, token=token, cache=cache, result=result)
    propose, _ = spec.round_fns(target, draft, params, stop_ids, max_tokens, self.pad_id,
                                k=self.k, tree=self.tree)
    x0, L, result, cand, cache, dcache, stats = spec.spec_prefill(
        target, draft, propose, req, self.capacity, result, stop, self.width, cache=cache,
        dcache=dcache, start=start)
    return dict(row, x0=x0, L=L, result=result, cand=cand, cache=cache, dcache=dcache,
                stats=stats)

  def _init(self, states):
    """All-free slots: every row done, lengths 0."""
    B = self.slots
    params = sampling.default_params(1, self.max_logit_bias)
    paged = () if self._paging is None else self._empty_paged()
    row = jax.eval_shape(
        self._new_row, states, jnp.zeros((1, self.buckets[0]), jnp.int32),
        jnp.ones((1,), jnp.int32), params, jnp.zeros((1, self.max_stop_ids), jnp.int32),
        jnp.ones((1,), jnp.int32), *paged)
    rows = self._map_rows(lambda s: jnp.zeros((B,) + s.shape[1:], s.dtype), row)
    rows = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct)
                        else x, rows)
    rows["result"] = dataclasses.replace(rows["result"], done=jnp.ones((B,), bool))
    rows["stop_ids"] = jnp.full_like(rows["stop_ids"], plain.NO_STOP)
    rows["params"] = sampling.default_params(B, self.max_logit_bias)
    return self._constrain(rows)

  def _insert(self, states, rows, slot, prompt, length, params, stop_ids, max_tokens, tables,
              suffix=None, start=None, prior=None, num_prior=None, prompt_length=None,
              pixels=None):
    """tables [1, P, M]: the new row's block tables (paged), else None; pixels: the request's
    image tiles (start 0), else None; the rest: see _new_row (paged)."""
    new = self._new_row(states, prompt, length, params, stop_ids, max_tokens,
                        *self._paged_rows(rows, tables), suffix=suffix, start=start, prior=prior,
                        num_prior=num_prior, prompt_length=prompt_length, pixels=pixels)
    put = lambda big, small: jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype),
                                                                 slot, axis=0)
    return self._constrain(self._map_rows(put, rows, new))

  def _step(self, states, all_rows, release, tables, *, n: int):
    """Runs the first n slots (a batch bucket); the others are left as they are. tables
    [slots, P, M]: the block tables of a paged cache (the host's, sent with every call), else
    None."""
    target, draft = self._models(states)
    rows = self._constrain(self._map_rows(lambda x: x[:n], all_rows))
    if self._paging is not None:
      rows["cache"] = rows["cache"].with_tables(tables[:n])
      if "dcache" in rows:
        rows["dcache"] = rows["dcache"].with_tables(tables[:n, :1])
    result = rows["result"]
    result = dataclasses.replace(result, done=result.done | release[:n])
    done0 = result.done
    stop = lambda out, new, n, lp: sampling.append(out, new, n, rows["stop_ids"],
                                                   rows["max_tokens"], self.pad_id, lp)

    def cond(carry):
      step, result = carry[0], carry[3]
      return (step < self.rounds) & ~jnp.any(result.done & ~done0) & ~jnp.all(result.done)

    if draft is None:
      def body(carry):
        step, token, cache, result = carry
        token, cache, result = plain.decode_round(target, token, cache, result, rows["params"],
                                                  rows["stop_ids"], stop)
        return step + 1, token, cache, result
      carry = (0, rows["token"], rows["cache"], result)
      _, token, cache, result = jax.lax.while_loop(cond, body, carry)
      rows = dict(rows, token=token, cache=cache, result=result)
    else:
      _, body = spec.round_fns(target, draft, rows["params"], rows["stop_ids"], rows["max_tokens"],
                               self.pad_id, k=self.k, tree=self.tree)
      carry = (0, rows["x0"], rows["L"], result, rows["cand"], rows["cache"], rows["dcache"],
               rows["stats"])
      _, x0, L, result, cand, cache, dcache, stats = jax.lax.while_loop(cond, body, carry)
      rows = dict(rows, x0=x0, L=L, result=result, cand=cand, cache=cache, dcache=dcache,
                  stats=stats)
    take = lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, self.window)
    window = jax.vmap(take)(result.tokens, rows["emitted"])
    num_new = result.num_tokens - rows["emitted"]
    report = dict(window=window, num_new=num_new, done=result.done,
                  **{name: jax.vmap(take)(getattr(result, name), rows["emitted"])
                     for name in LOGPROB_FIELDS})
    rows["emitted"] = result.num_tokens
    if draft is not None:
      report.update(rounds=rows["stats"].rounds, accepted=rows["stats"].accepted)
    put = lambda big, small: jax.lax.dynamic_update_slice_in_dim(big, small, 0, axis=0)
    return self._constrain(self._map_rows(put, all_rows, rows)), report

  def compile(self, progress: Callable[[str], None] | None = None) -> float:
    """Compiles the step and every prompt bucket's insert; returns the seconds it took."""
    start = time.perf_counter()
    note = progress or (lambda what: None)
    note("init")
    self._slots_state = rows = jax.jit(self._init)(self._states)
    release = jax.device_put(np.zeros((self.slots,), bool))
    tables = self._tables()
    for n in self.batch_buckets:
      for w in (None,) if self._paging is None else self._paging.widths:
        note(f"step batch {n}" + ("" if w is None else f" width {w}"))
        self._exes[self._step_key(n, w)] = jax.jit(functools.partial(self._step, n=n),
                                                   donate_argnums=(1,)).lower(
            self._states, rows, release, None if w is None else tables[:, :, :w]).compile()
    if self.compaction:
      slot = jax.device_put(np.int32(0))
      self._exes["move",] = jax.jit(functools.partial(compaction_lib.move_row, self),
                                    donate_argnums=(0,)).lower(rows, slot, slot).compile()
    insert = jax.jit(self._insert, donate_argnums=(1,))
    for b in self.buckets:
      note(f"prefill bucket {b}")
      params = sampling.SamplingParams.create(1, bias_width=self.max_logit_bias)
      args = self._host_args(0, [0] * b, params, self.default_stop, 1)
      self._exes[b] = insert.lower(self._states, rows, *args).compile()
    return time.perf_counter() - start

  def _host_args(self, slot, prompt, params, stop_ids, max_tokens, start: int = 0, prior=()):
    """The insert program's arguments; its bucket is that of (prompt + prior)[start:], the part
    to prefill. Paged: the whole prompt (penalty marks) and `prior` (the tokens a preempted
    request had produced, which the new row starts with) go along padded to max_seq_len."""
    def padded(tokens, width):
      out = np.zeros((1, width), np.int32)
      out[0, :len(tokens)] = tokens
      return out
    stop = np.full((1, self.max_stop_ids), plain.NO_STOP, np.int32)
    stop[0, :len(stop_ids)] = stop_ids
    put = jax.device_put
    context = list(prompt) + list(prior)
    suffix = padded(context[start:], self.bucket(len(context) - start))
    paged = self._paging is not None
    whole = padded(prompt, self.max_seq_len) if paged else suffix
    length = lambda n: put(np.array([n], np.int32))
    args = (put(np.int32(slot)), put(whole), length(len(context)), params,
            put(stop), put(np.array([max_tokens], np.int32)), self._tables(slot))
    if paged:
      args += (put(suffix), length(start), put(padded(prior, self.max_seq_len)),
               length(len(prior)), length(len(prompt)))
    return args

  def _step_key(self, n: int, width: int | None):
    full = width is None or width == self._paging.max_blocks
    return ("step", n) if full else ("step", n, width)

  def _tables(self, slot: int | None = None, width: int | None = None):
    """The host's block tables on the device: all slots, or one slot's [1, P, M]; None when the
    cache is contiguous."""
    if self._paging is None:
      return None
    t = self._paging.tables
    # A copy: on CPU device_put may alias a contiguous NumPy array, and the host edits its tables
    # (moves, frees, reservations) while the call that got them may not have run yet.
    return jax.device_put(np.array(t[:, :, :width] if slot is None else t[slot:slot + 1]))

  def bucket(self, n: int) -> int:
    return next(b for b in self.buckets if b >= n)

  def batch_bucket(self, busy: int) -> int:
    """The step program for slots [0, busy): the smallest batch bucket holding them."""
    return next(n for n in self.batch_buckets if n >= busy)

  # ---------------------------------------------------------------------------------------------
  # Host side
  # ---------------------------------------------------------------------------------------------
  def submit(self, prompt: Sequence[int], callback: Callable[[Event], None], *,
             max_tokens: int = 16, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int = 0, stop_tokens: Sequence[int] | None = None,
             presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             repetition_penalty: float = 1.0, min_p: float = 0.0, min_tokens: int = 0,
             logit_bias: dict[int, float] | None = None, logprobs: int | None = None,
             prompt_logprobs: bool = False, images=None, max_tiles: int | None = None) -> Handle:
    """Validates and queues a request (a RequestError, before it touches a slot, when it cannot
    run). The sampling options are those of `maverick.sampling.SamplingParams.create`; the
    request's random stream depends only on `seed`, so a seeded request samples the same tokens
    whatever else runs beside it. logprobs=N (0..20) adds each token's logprob and the N most
    likely alternatives to the events; prompt_logprobs=True adds the prompt's to the first.
    images (a model with a vision tower): the request's images in prompt order, as
    `maverick.generate(images=)` takes them; the prompt holds their token layouts."""
    self._raise_if_failed()
    cfg = self.config
    prompt = [int(t) for t in prompt]
    if not prompt:
      raise RequestError("the prompt is empty: it needs at least one token", "prompt")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
      raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, "
                         f"{cfg.vocab_size})", "prompt")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) \
        or max_tokens < 1:
      raise RequestError(f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    n, context = len(prompt), self.max_seq_len
    if n >= context:  # no max_tokens fits: the prompt is what to change
      raise RequestError(f"the prompt has {n} tokens{images_lib.of_which(self, prompt)} and this "
                         f"server's context of {context} tokens must hold the prompt and at least "
                         f"one new token: shorten the prompt to at most {context - 1} tokens",
                         "prompt", "context_length_exceeded")
    if n + max_tokens > context:
      raise RequestError(f"the prompt ({n} tokens) + max_tokens ({max_tokens}) = "
                         f"{n + max_tokens} tokens does not fit this server's context of "
                         f"{context} tokens; lower max_tokens to at most {context - n} or shorten "
                         f"the prompt", "max_tokens", "context_length_exceeded")
    why = None if self._paging is None else self._paging.never_fits(n, int(max_tokens))
    if why:
      raise RequestError(why, "max_tokens", "context_length_exceeded")
    if isinstance(seed, bool) or not (isinstance(seed, (int, np.integer)) and 0 <= seed < 2**32):
      raise RequestError(f"seed must be an integer in [0, 2**32), got {seed!r}", "seed")
    stop_ids = self.default_stop if stop_tokens is None else list(stop_tokens)
    stop_row = plain._stop_matrix(cfg, 1, stop_ids)[0]
    if len(stop_ids) > self.max_stop_ids:
      raise RequestError(f"at most {self.max_stop_ids} stop token ids per request, got "
                         f"{len(stop_ids)}")
    if not isinstance(prompt_logprobs, bool):
      raise RequestError(f"prompt_logprobs must be true or false, got {prompt_logprobs!r}",
                         "prompt_logprobs")
    try:
      pixels = images_lib.request_pixels(self, prompt, images, max_tiles)
    except (ValueError, ImportError) as e:
      raise RequestError(str(e), "images") from None
    if pixels is not None and prompt_logprobs:
      raise RequestError("prompt_logprobs is not supported with images", "prompt_logprobs")
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                   presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                   repetition_penalty=repetition_penalty, min_tokens=min_tokens,
                   logit_bias=logit_bias, logprobs=logprobs)
    if logit_bias is not None and not isinstance(logit_bias, dict):
      raise RequestError(f"logit_bias must be a map of token id to bias, got {logit_bias!r}",
                         "logit_bias")
    try:
      params = sampling.SamplingParams.create(1, seed=[int(seed)], vocab_size=cfg.vocab_size,
                                              bias_width=self.max_logit_bias, **options)
    except ValueError as e:  # the message names the parameter first
      raise RequestError(str(e), next((k for k in options if str(e).startswith(k)), None)) \
          from None
    h = Handle(id=next(self._ids), prompt=prompt, max_tokens=int(max_tokens),
               stop_ids=frozenset(int(t) for t in stop_row if t != plain.NO_STOP),
               callback=callback, params=params, stop_row=stop_row,
               logprobs=None if logprobs is None else int(logprobs),
               prompt_logprobs=bool(prompt_logprobs),
               submitted=time.perf_counter(), pixels=pixels)
    with self._failure:  # not queued after the engine failed: it would wait forever
      self._raise_if_failed()
      self._waiting.put(h)
    self._wake.set()
    return h

  def _raise_if_failed(self) -> None:
    if self.error is not None:
      raise RuntimeError(f"the engine stopped on an error and serves no more requests: "
                         f"{self.error!r}")

  def cancel(self, handle: Handle) -> None:
    """Stops a request: no more events; its slot is freed at the next step."""
    handle.cancelled = True
    self._wake.set()

  def start(self) -> None:
    if self._slots_state is None:
      self.compile()
    self._thread = threading.Thread(target=self._run, name="maverick-engine", daemon=True)
    self._thread.start()

  def shutdown(self, timeout: float = 30.0) -> None:
    self._stop = True
    self._wake.set()
    if self._thread is not None:
      self._thread.join(timeout)

  def kv_stats(self) -> dict:
    """The KV layout and, paged, each pool's blocks used / free (evictable cached ones count as
    free), the block size, the prefix hit rate (prompt tokens served from the prefix cache) and
    preemptions: what /health reports."""
    if self._paging is None:
      return {"kv_layout": "contiguous"}
    return {"kv_layout": "paged", "block_size": self._paging.block_size,
            "preemptions": self.preemptions, **self._paging.stats()}

  @property
  def active(self) -> int:
    return sum(h is not None for h in self._owner)

  def _run(self) -> None:
    try:
      self._loop()
    except BaseException as e:  # noqa: BLE001  (reported to every open request)
      with self._failure:
        self.error = e
      self._fail_open_requests()

  def _fail_open_requests(self) -> None:
    """After an engine error: every running and waiting request ends with an "error" event."""
    waiting = [] if self._head is None else [self._head]
    while not self._waiting.empty():
      waiting.append(self._waiting.get())
    for h in [h for h in self._owner if h is not None] + waiting:
      if not h.finished:
        h.finished = True
        h.callback(Event([], True, "error", time.perf_counter()))

  def _loop(self) -> None:
    pending = None
    # Slots whose request was cancelled: marked done by the next step (kept until one runs).
    release = np.zeros((self.slots,), bool)
    while not self._stop:
      for b, h in enumerate(self._owner):
        if h is not None and h.cancelled:
          self._owner[b], release[b] = None, True
          self.released += 1
          if self._paging is not None:
            self._paging.free(b, h.id)
      self._admit(release)
      if self._paging is not None:
        self._reserve(release)
      self._compact(release)
      if self.active:
        # Released slots are in the step too, so their rows get marked done.
        busy = 1 + max(b for b in range(self.slots) if self._owner[b] is not None or release[b])
        n = self.batch_bucket(busy)
        w = None if self._paging is None else self._paging.width(n)
        rows, report = self._exes[self._step_key(n, w)](
            self._states, self._slots_state, jax.device_put(release), self._tables(width=w))
        release = np.zeros((self.slots,), bool)
        self._slots_state = rows
        self.steps += 1
        self.steps_by_batch[n] += 1
        current = (report, list(self._owner[:n]))
      else:
        current = None
      if pending is not None:
        self._process(*pending)  # step t's results while step t+1 runs
      pending = current
      if pending is None:
        self._wake.wait(0.05)
        self._wake.clear()

  def _compact(self, release: np.ndarray) -> None:
    if not self.compaction:
      return
    owned = [h is not None for h in self._owner]
    for src, dst in compaction_lib.plan_moves(owned, release, self.batch_bucket):
      put = lambda b: jax.device_put(np.int32(b))
      self._slots_state = self._exes["move",](self._slots_state, put(src), put(dst))
      self._owner[dst], self._owner[src] = self._owner[src], None
      if self._paging is not None:
        self._paging.move(src, dst)
      self.moves += 1

  def _reserve(self, release: np.ndarray) -> None:
    """Blocks for the next call's writes, oldest request first; when the pool runs dry
    (preemption on), the youngest running request gives back all its blocks and is requeued."""
    for h in sorted((h for h in self._owner if h is not None), key=lambda h: h.admitted):
      while h in self._owner:
        try:
          self._paging.reserve(self._owner.index(h), h.id, len(h.prompt) + h.num_tokens)
          break
        except blocks.OutOfBlocks:
          if not self.preemption:
            raise
          victim = max((v for v in self._owner if v is not None), key=lambda v: v.admitted)
          b = self._owner.index(victim)
          self._owner[b], release[b] = None, True
          self._paging.free(b, victim.id)
          self._preempted.appendleft(victim)
          self.preemptions += 1

  def _admit(self, release: np.ndarray) -> None:
    for b in range(self.slots):
      if self._owner[b] is not None:
        continue
      h, self._head = self._head, None
      while h is None and self._preempted:
        h = self._preempted.popleft()
        h = None if h.finished else h  # it finished in the call in flight when preempted
      if h is not None and h.cancelled:
        h = None
      while h is None and not self._waiting.empty():
        h = self._waiting.get()
        if h.cancelled:
          h = None
      if h is None:
        return
      if self._paging is not None:
        # A preempted request resumes: prompt + its tokens so far are prefilled (recomputed).
        context = h.prompt + h.output
        if not self._paging.fits(len(context), h.max_tokens - len(h.output)):
          self._head = h  # first in line: admitted as soon as finished requests free blocks
          return
        try:
          start = self._paging.admit(b, h.id, context, h.max_tokens - len(h.output),
                                     private=h.pixels is not None)
        except blocks.OutOfBlocks:  # a prefix hit on evictable blocks can need more than fits saw
          self._paging.free(b, h.id)
          self._head = h
          return
      else:
        start = 0
      if h.prompt_logprobs and h.num_tokens == 0:  # a forward of its own: one insert shape
        h.prompt_result = plain.prompt_logprobs(self.model, h.prompt, h.logprobs or 0)
      bucket = self.bucket(len(h.prompt) + len(h.output) - start)
      args = self._host_args(b, h.prompt, h.params, sorted(h.stop_ids), h.max_tokens, start,
                             h.output)
      self._slots_state = (self._exes[bucket](self._states, self._slots_state, *args)
                           if h.pixels is None else images_lib.insert(self, bucket, args, h.pixels))
      self._owner[b], release[b] = h, False
      h.admitted = time.perf_counter()
      self.peak_active = max(self.peak_active, self.active)

  def _process(self, report, owners) -> None:
    # The logprob windows come to the host only when a request in the step asked for them.
    wanted = any(h is not None and h.logprobs is not None for h in owners)
    report = {name: sharding.to_host(v) for name, v in report.items()
              if wanted or name not in LOGPROB_FIELDS}
    now = time.perf_counter()
    for b, h in enumerate(owners):
      if h is None or h.finished or h.cancelled:
        continue
      n = int(report["num_new"][b])
      done = bool(report["done"][b])
      tokens = report["window"][b, :n].tolist()
      h.num_tokens += n
      if self._paging is not None:
        h.output.extend(tokens)
        self._paging.commit(h.id, h.prompt + h.output)
      reason = None
      if done:
        h.finished = True
        self.finished += 1
        if "rounds" in report:
          self.spec_rounds += int(report["rounds"][b])
          self.spec_accepted += int(report["accepted"][b])
        reason = "stop" if tokens and tokens[-1] in h.stop_ids else "length"
        # h ran in slot b; compaction may have moved it since.
        slot = next((i for i, o in enumerate(self._owner) if o is h), None)
        if slot is not None:
          self._owner[slot] = None
          if self._paging is not None:
            self._paging.free(slot, h.id)
      if n or done:
        logprobs = None if h.logprobs is None else sampling.logprob_lists(
            *(report[name][b] for name in LOGPROB_FIELDS), n, h.logprobs)
        h.callback(Event(tokens, done, reason, now,
                         int(report["rounds"][b]) if "rounds" in report else 0,
                         int(report["accepted"][b]) if "accepted" in report else 0, logprobs,
                         h.prompt_result))
        h.prompt_result = None  # the first event carries them
