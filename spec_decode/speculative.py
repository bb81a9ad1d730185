"""EAGLE-3 speculative generation as ONE jitted call: prefill, then a `lax.while_loop` of rounds.

A round (K static): verify [x0, c_1..c_K] with one target forward over K+1 tokens (capturing the aux
features), accept on device, commit by moving per-row length pointers (rejected KV is simply
overwritten next round), extend the draft over the verified positions from the target features, and
draft the next K candidates. With a TreeShape the candidates are an EAGLE-2 tree instead
(spec_decode/tree.py): the target verifies every node in the same single forward under a tree mask,
and the accepted path's KV entries are moved into place before the draft extends over it. Rows
finish on stop tokens / max tokens independently; all shapes are fixed, so finished rows keep
computing but commit nothing.

Shares the KV cache, sampling and stopping code with `maverick.generate`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maverick import generation as plain
from maverick import kernels as kernels_lib
from maverick import program_cache
from maverick import sampling
from maverick import sharding
from maverick.model import Llama4, TreeMask
from spec_decode.draft import Eagle3Draft
from spec_decode.tree import (MAX_DRAFT_DEPTH, TreeShape, commit_path, draft_tree, gather_path, verify_layout,
                              verify_tree)
from spec_decode.verify import Candidates, chain_history, chain_parents, verify_chain


# Named scopes of a round's pieces: a profile of one generate call attributes every compiled op to
# one of them (benchmarks/spec_decode.py's round breakdown).
SCOPES = {piece: f"spec_{piece}" for piece in
          ("verify", "accept", "bookkeeping", "draft_extend", "draft")}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecStats:
  rounds: jax.Array  # [B] verify rounds while the row was active
  accepted: jax.Array  # [B] sum over rounds of (accepted drafts + 1): tokens per verify step
  accepted_at: jax.Array  # [B, K] rounds in which draft position j was accepted


# A program output: its structure is saved with exported programs (maverick.program_cache).
jax.export.register_pytree_node_serialization(
    SpecStats, serialized_name="spec_decode.speculative.SpecStats",
    serialize_auxdata=lambda aux: b"", deserialize_auxdata=lambda data: ())


def _features(hidden):  # [3, B, T, D] captured layer outputs -> [B, T, 3D], low..high
  return jnp.concatenate(list(hidden), axis=-1)


def draft_chain(draft: Eagle3Draft, logits, hidden, dcache, committed, embed, params,
                result: sampling.Output, stop_ids, *, k: int, vocab: int
                ) -> tuple[Candidates, object]:
  """From the draft's output at the last committed position, draft K candidates by a chain of
  single-token draft steps at positions committed, committed+1, ... (overwriting stale entries).
  q of draft j gets the target's logit transforms with the committed history `result` plus drafts
  0..j-1, and its draw comes from the row's stream at token index result.num_tokens + j.
  The K-1 draft steps are one `fori_loop`, so compile time does not grow with K."""
  B = logits.shape[0]

  def sample(j, logits, tokens, probs):
    """Draws draft token j and records it with q, the distribution it was drawn from. All rows
    greedy and no logit transform: q is one-hot at the argmax and verification never reads it, so
    only the argmax is computed (no [B, V] work)."""
    # Column j is written with a select, not `.at[:, j].set`: with one row that update is a
    # contiguous slice, which XLA:GPU turns into an async memcpy on a second stream; that is no
    # command-buffer command, and it kept the whole speculative `while` host-driven.
    at_j = jnp.arange(k) == j

    def transformed(probs):
      earlier = jnp.where(jnp.arange(k)[None, :] < j, tokens, -1)
      lifted = sampling.adjust_rows(draft.lift_logits(logits, vocab), params, result, stop_ids,
                                    earlier)
      q = sampling.probabilities(lifted, params)
      keys = sampling.row_keys(params, result.num_tokens + j, sampling.SALT_DRAFT)
      return sampling.draw(keys, jnp.log(q), params), jnp.where(at_j[:, None], q[:, None], probs)

    def greedy(probs):
      return draft.target_ids(jnp.argmax(logits, axis=-1)).astype(jnp.int32), probs

    general = sampling.any_sampled(params) | sampling.needs_adjust(params)
    tok, probs = jax.lax.cond(general, transformed, greedy, probs)
    return tok, jnp.where(at_j, tok[:, None], tokens), probs

  def step(j, carry):
    logits, hidden, dcache, tokens, probs = carry
    tok, tokens, probs = sample(j, logits, tokens, probs)
    out = draft(tok[:, None], hidden[:, None], embed, cache=dcache.with_lengths(committed + j))
    return out.logits[:, 0], out.hidden[:, 0], out.cache, tokens, probs

  tokens = jnp.zeros((B, k), jnp.int32)
  probs = jnp.zeros((B, k, vocab), jnp.float32)
  logits, _, dcache, tokens, probs = jax.lax.fori_loop(
      0, k - 1, step, (logits, hidden, dcache, tokens, probs))
  # The last draft token needs no draft step after it.
  _, tokens, probs = sample(k - 1, logits, tokens, probs)
  return Candidates(tokens, probs, chain_parents(k)), dcache


def round_fns(target: Llama4, draft: Eagle3Draft, params: sampling.SamplingParams, stop_ids,
              max_tokens, pad_id: int, *, k: int | None, tree: TreeShape | None):
  """(propose, body) of a speculative round, shared by `_spec_generate` and the serving engine
  (maverick/serving). body maps the carry (step, x0, L, result, cand, cache, dcache, stats) to
  the next round's; rows stop on stop_ids [B, n] / max_tokens [B]. Done rows commit nothing.
  Every random draw comes from the rows' own streams (params.seed), keyed by token index."""
  stop = lambda out, new, n, lp: sampling.append(out, new, n, stop_ids, max_tokens, pad_id, lp)
  aux = draft.config.aux_layer_ids
  V = target.config.vocab_size
  embed = target.embed[...]
  width = k if tree is None else tree.depth  # draft tokens on one accepted path

  def propose(logits, hidden, dcache, committed, result):
    if tree is None:
      return draft_chain(draft, logits, hidden, dcache, committed, embed, params, result,
                         stop_ids, k=k, vocab=V)
    return draft_tree(draft, logits, hidden, dcache, committed, embed, tree)

  def verify(x0, cand, cache, L, result):
    """One target forward over [x0, candidates] -> (cache with the accepted path at L.., the
    path's features [B, width+1, 3D], its draft tokens [B, width], accepted n, next token, the
    target logits along the path [B, width+1, V])."""
    tokens = jnp.concatenate([x0[:, None], cand.tokens], axis=1)
    if tree is None:
      with jax.named_scope(SCOPES["verify"]):
        out = target(tokens, cache=cache.with_lengths(L), capture_layers=aux)
      with jax.named_scope(SCOPES["accept"]):
        n, nxt = verify_chain(out.logits, cand, params, result, stop_ids)
      return out.cache, _features(out.hidden), cand.tokens, n, nxt, out.logits
    parents, depths, ancestors = verify_layout(cand, tree.depth)
    positions = L[:, None] + depths
    with jax.named_scope(SCOPES["verify"]):
      out = target(tokens, positions, cache.with_lengths(L), capture_layers=aux,
                   tree=TreeMask(start=L, positions=positions, visible=ancestors))
    with jax.named_scope(SCOPES["accept"]):
      n, nxt, path = verify_tree(out.logits, tokens, parents, depths, ancestors, params, result,
                                 stop_ids, tree.depth)
      return (commit_path(out.cache, L, path), gather_path(_features(out.hidden), path),
              gather_path(tokens, path)[:, 1:], n, nxt, gather_path(out.logits, path))

  def body(carry):
    step, x0, L, result, cand, cache, dcache, stats = carry
    B = x0.shape[0]
    with jax.named_scope(SCOPES["bookkeeping"]):
      active = ~result.done
    cache, features, path_tokens, n, nxt, path_logits = verify(x0, cand, cache, L, result)
    with jax.named_scope(SCOPES["bookkeeping"]):
      emitted = jnp.concatenate([path_tokens, jnp.zeros((B, 1), jnp.int32)], axis=1)
      emitted = jnp.where(jnp.arange(width + 1)[None, :] == n[:, None], nxt[:, None], emitted)
      # Each emitted token's logprobs under p at its position (drafts before it in the history).
      logprobs = sampling.token_logprobs(path_logits, params, result, stop_ids, emitted,
                                         chain_history(path_tokens))
      result = stop(result, emitted, n + 1, logprobs)
      stats = SpecStats(
          stats.rounds + active, stats.accepted + jnp.where(active, n + 1, 0),
          stats.accepted_at + (active[:, None] & (jnp.arange(width)[None, :] < n[:, None])))
      L_new = jnp.where(active, L + n + 1, L)
      x0 = jnp.where(active, nxt, x0)
    # Draft extend over the verified path (token at p+1 = emitted[p - L]); keep row n.
    with jax.named_scope(SCOPES["draft_extend"]):
      dout = draft(emitted, draft.fuse(features), embed, cache=dcache.with_lengths(L), logits_at=n)
    with jax.named_scope(SCOPES["draft"]):
      cand, dcache = propose(dout.logits, dout.hidden, dout.cache, L_new, result)
    return step + 1, x0, L_new, result, cand, cache, dcache, stats

  return propose, body


def spec_prefill(target: Llama4, draft: Eagle3Draft, propose, req: plain.Request, capacity: int,
                 result: sampling.Output, stop, width: int, *, cache=None, dcache=None,
                 start=None):
  """Target prefill, first token (appended to the empty `result`), draft prefill and the first
  candidates. Returns the round carry without step: (x0, L, result, cand, cache, dcache, stats).
  `cache` / `dcache`: empty target / draft caches to fill (paged ones, see plain.prefill).
  `start` [B]: both caches already hold positions < start (a prefix-cache hit, see plain.prefill;
  the draft's entry at start - 1 must have been made from the same token at start)."""
  aux = draft.config.aux_layer_ids
  B, Tp = req.prompt.shape
  params = req.sampling
  embed = target.embed[...]
  out, cache = plain.prefill(target, req, capacity, capture_layers=aux, cache=cache, start=start)
  x0, logprobs = sampling.sample(out.logits, params, result, req.stop_ids)
  result = stop(result, x0[:, None], jnp.ones((B,), jnp.int32), logprobs)
  L = req.prompt_lengths
  last = L - 1 if start is None else L - 1 - start  # the last prompt token's index in req.prompt
  # Draft position p pairs the target feature at p with the token at p+1.
  shifted = jnp.concatenate([req.prompt[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
  shifted = jnp.where(jnp.arange(Tp)[None, :] == last[:, None], x0[:, None], shifted)
  if dcache is None:
    dcache = draft.init_cache(B, capacity)
  dcache = sharding.constrain_cache(dcache, sharding.plan_of(draft))
  dout = draft(shifted, draft.fuse(_features(out.hidden)), embed,
               cache=dcache if start is None else dcache.with_lengths(start),
               prefill=start is None, logits_at=last)
  cand, dcache = propose(dout.logits, dout.hidden, dout.cache, L, result)
  stats = SpecStats(jnp.zeros((B,), jnp.int32), jnp.zeros((B,), jnp.int32),
                    jnp.zeros((B, width), jnp.int32))
  return x0, L, result, cand, cache, dcache, stats


def _spec_generate(tgt_graphdef, tgt_state, dr_graphdef, dr_state, req: plain.Request, *, k: int,
                   steps: int, capacity: int, pad_id: int, tree: TreeShape | None = None):
  target: Llama4 = nnx.merge(tgt_graphdef, tgt_state)
  draft: Eagle3Draft = nnx.merge(dr_graphdef, dr_state)
  B = req.prompt.shape[0]
  stop = lambda out, new, n, lp: sampling.append(out, new, n, req.stop_ids, req.max_new_tokens,
                                                 pad_id, lp)
  width = k if tree is None else tree.depth  # draft tokens on one accepted path
  propose, body = round_fns(target, draft, req.sampling, req.stop_ids, req.max_new_tokens, pad_id,
                            k=k, tree=tree)
  x0, L, result, cand, cache, dcache, stats = spec_prefill(
      target, draft, propose, req, capacity,
      plain.init_output(target.config, req, B, steps, width + 1, pad_id), stop, width)

  def cond(carry):
    step, result = carry[0], carry[3]
    return (step < steps) & ~jnp.all(result.done)

  carry = (1, x0, L, result, cand, cache, dcache, stats)
  carry = jax.lax.while_loop(cond, body, carry)
  result, stats = carry[3], carry[7]
  return (result.tokens[:, :steps], result.num_tokens, stats,
          plain.output_logprobs(result, steps))


spec_generate_jit = jax.jit(
    _spec_generate, static_argnames=("tgt_graphdef", "dr_graphdef", "k", "steps", "capacity",
                                     "pad_id", "tree"))

_EXECUTABLES = plain.ExecutableCache()


def most_recent_executable():
  """The compiled program of the last speculative generate call (its HLO: `.as_text()`)."""
  return _EXECUTABLES.most_recent()


def compiled_spec_generate(tgt_graphdef, tgt_state, dr_graphdef, dr_state, req, *, k, steps,
                           capacity, pad_id, tree=None):
  """(compiled executable, seconds compiling now: 0.0 when cached)."""
  key = (tgt_graphdef, dr_graphdef, k, steps, capacity, pad_id, tree,
         plain.avals_key(tgt_state, dr_state, req))
  return _EXECUTABLES.get_or_compile(key, lambda: program_cache.lower(
      spec_generate_jit, tgt_graphdef, tgt_state, dr_graphdef, dr_state, req, k=k, steps=steps,
      capacity=capacity, pad_id=pad_id, tree=tree))


@dataclasses.dataclass
class SpecGeneration(plain.Generation):
  """`spec_decode.generate`'s result: `maverick.generate`'s fields plus the rounds, accepted
  drafts and per-position acceptance behind `acceptance_length` / `acceptance_rates`."""

  rounds: np.ndarray = None  # [B]
  accepted: np.ndarray = None  # [B]
  accepted_at: np.ndarray = None  # [B, K] (chain) or [B, depth] (tree)

  @property
  def acceptance_length(self) -> float:
    """Mean tokens per verify step (accepted drafts + the bonus/correction token)."""
    return float(self.accepted.sum()) / max(int(self.rounds.sum()), 1)

  @property
  def acceptance_rates(self) -> np.ndarray:
    """Per draft position (tree level) j: fraction of rounds that accepted at least j+1 drafts."""
    return self.accepted_at.sum(0) / max(int(self.rounds.sum()), 1)


def check_chain_k(k) -> int:
  """`k` draft tokens per chain round as an int; a ValueError naming --spec_k outside
  1..MAX_DRAFT_DEPTH (generation and the memory plan, scripts/plan_memory.py, take the same)."""
  if not (isinstance(k, (int, np.integer)) and k >= 1):
    raise ValueError(f"speculative decoding needs k >= 1 draft tokens per round, got k={k}; use "
                     "maverick.generate (or --spec_k 0) for plain decoding")
  if k > MAX_DRAFT_DEPTH:
    raise ValueError(f"k={k} draft tokens per round is past the limit of {MAX_DRAFT_DEPTH} "
                     f"(--spec_k): deeper drafts are almost never accepted and each costs a "
                     f"draft step and a verified position; use 3-8")
  return int(k)


def program(target: Llama4, draft: Eagle3Draft, prompts: Sequence[Sequence[int]], *,
            k: int = 3, tree: TreeShape | str | None = None, max_new_tokens=64,
            temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed=0,
            stop_tokens=None, max_cache_len: int | None = None,
            pad_id: int | None = None, images=None, max_tiles: int | None = None, **options):
  """(compiled program, its arguments, compile seconds) of one `generate` call with the same
  arguments: `generate` runs exactly `exe(*args)`, so benchmarks and profilers measure the same
  program (cache capacity rounded for the kernels included)."""
  if tree is not None:
    tree = TreeShape.parse(tree) if isinstance(tree, str) else tree
    if not isinstance(tree, TreeShape):
      raise TypeError(f"tree must be a TreeShape or 'DEPTHxTOPKxNODES', got {tree!r}")
    tree.check_draft_vocab(draft.config.draft_vocab_size)
    k, slack = None, tree.cache_slack
  else:
    k = check_chain_k(k)
    slack = k + 1  # a verify window may run K+1 positions past the last token
  draft.config.check_target(target.config)
  pixels = plain.image_inputs(target, prompts, images, max_tiles)
  req, steps, capacity = plain.prepare(
      target.config, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
      top_k=top_k, top_p=top_p, seed=seed, stop_tokens=stop_tokens, max_cache_len=max_cache_len,
      **options)
  capacity = kernels_lib.cache_capacity(capacity + slack, target, draft)
  req = plain.with_images(sharding.place_request(req, sharding.plan_of(target)), pixels, target)
  tgt_graphdef, tgt_state = nnx.split(target)
  dr_graphdef, dr_state = nnx.split(draft)
  exe, compile_s = compiled_spec_generate(
      tgt_graphdef, tgt_state, dr_graphdef, dr_state, req, k=k, steps=steps, capacity=capacity,
      pad_id=plain.resolve_pad_id(target.config, pad_id), tree=tree)
  return exe, (tgt_state, dr_state, req), compile_s


def generate(target: Llama4, draft: Eagle3Draft, prompts: Sequence[Sequence[int]], *,
             k: int = 3, tree: TreeShape | str | None = None, max_new_tokens=64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed=0,
             stop_tokens=None, max_cache_len: int | None = None,
             pad_id: int | None = None, images=None, max_tiles: int | None = None,
             **options) -> SpecGeneration:
  """Speculative generation with an EAGLE-3 draft: same arguments and output as
  `maverick.generate`, plus acceptance statistics. Lossless: greedy output equals plain
  greedy output, and sampled output has the target's distribution.

  k: chain drafting, k draft tokens per round. tree: EAGLE-2 dynamic tree drafting instead
  (`TreeShape(depth, topk, nodes)` or "DEPTHxTOPKxNODES"); k is then ignored. seed and options
  (penalties, min_p, min_tokens, logit_bias) as in `maverick.generate`: applied to the target's p
  and the draft's q alike, so sampling stays lossless. images, max_tiles: image prompts, as in
  `maverick.generate` (the target's prefill reads the image features; the draft reads the target's
  hidden states there as anywhere)."""
  exe, args, compile_s = program(
      target, draft, prompts, k=k, tree=tree, max_new_tokens=max_new_tokens,
      temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, stop_tokens=stop_tokens,
      max_cache_len=max_cache_len, pad_id=pad_id, images=images, max_tiles=max_tiles, **options)
  start = time.perf_counter()
  tokens, num, stats, lp = exe(*args)
  tokens, num = sharding.to_host(tokens), sharding.to_host(num)
  logprobs = plain.host_logprobs(lp, num, options.get("logprobs"))
  stats = jax.tree.map(sharding.to_host, stats)
  run_s = time.perf_counter() - start
  return SpecGeneration(
      tokens=[tokens[i, :n].tolist() for i, n in enumerate(num)], num_tokens=num,
      compile_seconds=compile_s, run_seconds=run_s, logprobs=logprobs, rounds=stats.rounds,
      accepted=stats.accepted, accepted_at=stats.accepted_at)
