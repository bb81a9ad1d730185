"""On-device sampling and stopping, shared by plain generation and speculative decoding.

Sampling parameters are traced per-row arrays, so changing any of them never recompiles.
Order (as vLLM): logit_bias, min_tokens (stop ids masked), penalties (repetition, frequency,
presence), then temperature, min_p, top-k, top-p. temperature == 0 means greedy for that row: the
argmax of the logits after bias, min_tokens and penalties.

Randomness is per row: a row's draws come from its own (seed, stream) folded with the index of the
token being drawn (and a salt per use), never from a batch-wide key, so a request samples the same
text alone or in any batch (up to f32 near-ties in the logits).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Salts: one random stream per use of a token index.
SALT_SAMPLE, SALT_DRAFT, SALT_ACCEPT, SALT_RESIDUAL = 0, 1, 2, 3
MAX_LOGIT_BIAS = 300  # entries per request, as OpenAI
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI (the buffers' static width)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingParams:
  temperature: jax.Array  # [B] float32, 0 = greedy
  top_k: jax.Array  # [B] int32, 0 = off
  top_p: jax.Array  # [B] float32 in (0, 1], 1 = off
  min_p: jax.Array  # [B] float32 in [0, 1], 0 = off
  presence_penalty: jax.Array  # [B] float32, 0 = off
  frequency_penalty: jax.Array  # [B] float32, 0 = off
  repetition_penalty: jax.Array  # [B] float32 > 0, 1 = off
  min_tokens: jax.Array  # [B] int32: stop ids masked until this many tokens were generated
  bias_ids: jax.Array  # [B, NB] int32 token ids of logit_bias, -1 = unused entry
  bias_values: jax.Array  # [B, NB] float32
  seed: jax.Array  # [B] uint32
  stream: jax.Array  # [B] uint32: rows with one seed draw apart (generate's row index)
  logprobs: jax.Array  # [B] int32: top alternatives reported per token, -1 = no logprobs

  @classmethod
  def create(cls, batch_size: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, *, min_p: float = 0.0, presence_penalty: float = 0.0,
             frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
             min_tokens: int = 0, logit_bias: Mapping[int, float] | None = None,
             seed: int | Sequence[int] = 0, vocab_size: int | None = None,
             bias_width: int | None = None, logprobs: int | None = None) -> "SamplingParams":
    """Validates on the host and broadcasts to [B] (ValueError naming the parameter).

    seed: one int (row b then draws from stream b of it) or one seed per row (stream 0 each, as a
    single request with that seed). logit_bias {token id: bias in [-100, 100]} applies to every
    row, padded to bias_width entries (default: its size)."""
    check = lambda ok, msg: None if ok else (_ for _ in ()).throw(ValueError(msg))
    num = lambda v: isinstance(v, (int, float, np.integer, np.floating)) and \
        not isinstance(v, bool) and math.isfinite(v)
    check(num(temperature) and temperature >= 0,
          f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    check(num(top_p) and 0 < top_p <= 1, f"top_p must be in (0, 1] (1 = off), got {top_p}")
    check(isinstance(top_k, (int, np.integer)) and not isinstance(top_k, bool) and top_k >= 0,
          f"top_k must be an integer >= 0 (0 = off), got {top_k}")
    check(num(min_p) and 0 <= min_p <= 1, f"min_p must be in [0, 1] (0 = off), got {min_p}")
    for name, v in (("presence_penalty", presence_penalty),
                    ("frequency_penalty", frequency_penalty)):
      check(num(v) and -2 <= v <= 2, f"{name} must be a number in [-2, 2] (0 = off), got {v}")
    check(num(repetition_penalty) and 0 < repetition_penalty <= 10,
          f"repetition_penalty must be in (0, 10] (1 = off), got {repetition_penalty}")
    check(logprobs is None or (isinstance(logprobs, (int, np.integer))
                               and not isinstance(logprobs, bool)
                               and 0 <= logprobs <= MAX_LOGPROBS),
          f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (top alternatives per token) or "
          f"None, got {logprobs!r}")
    check(isinstance(min_tokens, (int, np.integer)) and not isinstance(min_tokens, bool)
          and min_tokens >= 0, f"min_tokens must be an integer >= 0, got {min_tokens}")
    bias = dict(logit_bias or {})
    width = max(1, len(bias)) if bias_width is None else bias_width
    check(len(bias) <= width, f"logit_bias has {len(bias)} entries, at most {width} are allowed")
    ids = np.full((width,), -1, np.int32)
    vals = np.zeros((width,), np.float32)
    for i, (t, v) in enumerate(sorted(bias.items())):
      try:
        t = int(t)  # JSON object keys arrive as strings
      except (TypeError, ValueError):
        raise ValueError(f"logit_bias keys must be token ids, got {t!r}") from None
      check(t >= 0 and (vocab_size is None or t < vocab_size),
            f"logit_bias token id {t} is outside the vocabulary [0, {vocab_size})")
      check(num(v) and -100 <= v <= 100, f"logit_bias values must be in [-100, 100], got {v!r}")
      ids[i], vals[i] = t, v
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
      check(0 <= seed < 2**32, f"seed must be an integer in [0, 2**32), got {seed!r}")
      seeds, streams = np.full((batch_size,), seed, np.uint32), np.arange(batch_size,
                                                                          dtype=np.uint32)
    else:
      seeds = np.asarray(seed)
      check(seeds.shape == (batch_size,) and seeds.dtype.kind in "iu"
            and ((seeds >= 0) & (seeds < 2**32)).all(),
            f"seed must be an integer in [0, 2**32) or one per row ({batch_size}), got {seed!r}")
      seeds, streams = seeds.astype(np.uint32), np.zeros((batch_size,), np.uint32)
    # NumPy then one transfer each: jnp.full or jnp.asarray would compile a program per shape.
    put = jax.device_put
    full = lambda v, dt: put(np.full((batch_size,), v, dt))
    rows = lambda a: put(np.broadcast_to(a, (batch_size,) + a.shape).copy())
    return cls(full(temperature, np.float32), full(int(top_k), np.int32),
               full(top_p, np.float32), full(min_p, np.float32),
               full(presence_penalty, np.float32), full(frequency_penalty, np.float32),
               full(repetition_penalty, np.float32), full(int(min_tokens), np.int32),
               rows(ids), rows(vals), put(seeds), put(streams),
               full(-1 if logprobs is None else int(logprobs), np.int32))


def default_params(batch_size: int, bias_width: int = 1) -> SamplingParams:
  """Greedy rows with every option off, built with jnp (usable inside a traced function)."""
  f = lambda v, dt: jnp.full((batch_size,), v, dt)
  return SamplingParams(f(0, jnp.float32), f(0, jnp.int32), f(1, jnp.float32), f(0, jnp.float32),
                        f(0, jnp.float32), f(0, jnp.float32), f(1, jnp.float32), f(0, jnp.int32),
                        jnp.full((batch_size, bias_width), -1, jnp.int32),
                        jnp.zeros((batch_size, bias_width), jnp.float32), f(0, jnp.uint32),
                        f(0, jnp.uint32), f(-1, jnp.int32))


def row_keys(params: SamplingParams, index: jax.Array, salt: int) -> jax.Array:
  """One key per row [B]: the row's (seed, stream) folded with the token index [B] and a salt."""
  def one(seed, stream, i):
    key = jax.random.fold_in(jax.random.key(seed), stream)
    return jax.random.fold_in(jax.random.fold_in(key, i), salt)
  return jax.vmap(one)(params.seed, params.stream, index)


def uniform(keys: jax.Array, n: int) -> jax.Array:
  """[B, n] uniforms in [0, 1), row b from keys[b] only."""
  return jax.vmap(lambda k: jax.random.uniform(k, (n,)))(keys)


# ----------------------------------------------------------------------------------------------
# Per-row token history: output buffer, counts, done flags
# ----------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Output:
  tokens: jax.Array  # [B, capacity + pad] generated tokens, pad_id after the end
  num_tokens: jax.Array  # [B] int32
  done: jax.Array  # [B] bool
  counts: jax.Array  # [B, V] int32: how often each token was generated (penalties)
  prompt_seen: jax.Array  # [B, V] bool: tokens of the prompt (repetition penalty)
  logprob: jax.Array  # [B, capacity + pad] f32: log-probability of each generated token
  top_ids: jax.Array  # [B, capacity + pad, MAX_LOGPROBS] int32: the most likely tokens there
  top_logprobs: jax.Array  # [B, capacity + pad, MAX_LOGPROBS] f32: their log-probabilities


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TokenLogprobs:
  """Log-probabilities of M tokens per row under the distribution each was sampled from (after
  every transform and the temperature; greedy rows: temperature 1), with the top alternatives."""
  logprob: jax.Array  # [B, M] f32
  top_ids: jax.Array  # [B, M, MAX_LOGPROBS] int32 (-1 past the vocabulary)
  top_logprobs: jax.Array  # [B, M, MAX_LOGPROBS] f32


# A program output: its structure is saved with exported programs (maverick.program_cache).
jax.export.register_pytree_node_serialization(
    TokenLogprobs, serialized_name="maverick.sampling.TokenLogprobs",
    serialize_auxdata=lambda aux: b"", deserialize_auxdata=lambda data: ())


def no_logprobs(batch: int, m: int) -> TokenLogprobs:
  return TokenLogprobs(jnp.zeros((batch, m), jnp.float32),
                       jnp.full((batch, m, MAX_LOGPROBS), -1, jnp.int32),
                       jnp.full((batch, m, MAX_LOGPROBS), -jnp.inf, jnp.float32))


def init_output(batch_size: int, capacity: int, max_append: int, pad_id: int, prompt: jax.Array,
                prompt_lengths: jax.Array, vocab_size: int) -> Output:
  """An empty output for prompts [B, Tp] (right-padded to prompt_lengths [B])."""
  # max_append extra columns so a write at the last position never clamps.
  in_prompt = jnp.arange(prompt.shape[1])[None, :] < prompt_lengths[:, None]
  seen = jnp.zeros((batch_size, vocab_size), bool).at[
      jnp.arange(batch_size)[:, None], jnp.where(in_prompt, prompt, vocab_size)].set(
          True, mode="drop")
  lp = no_logprobs(batch_size, capacity + max_append)
  return Output(tokens=jnp.full((batch_size, capacity + max_append), pad_id, jnp.int32),
                num_tokens=jnp.zeros((batch_size,), jnp.int32),
                done=jnp.zeros((batch_size,), bool),
                counts=jnp.zeros((batch_size, vocab_size), jnp.int32), prompt_seen=seen,
                logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)


def empty_output(batch_size: int, vocab_size: int, columns: int = 1) -> Output:
  """An output with no history (planning and benchmarks of a round)."""
  return init_output(batch_size, columns, 0, 0, jnp.zeros((batch_size, 1), jnp.int32),
                     jnp.zeros((batch_size,), jnp.int32), vocab_size)


def append(out: Output, new: jax.Array, num_new: jax.Array, stop_ids: jax.Array,
           max_tokens: jax.Array, pad_id: int, logprobs: TokenLogprobs | None = None) -> Output:
  """Appends up to num_new[b] tokens of new [B, M] to each unfinished row.

  A row takes tokens up to and including its first stop token and never more than max_tokens[b] in
  total; then it is done. stop_ids [B, n] is padded with -1. The taken tokens are counted, and
  their `logprobs` (if given) written beside them.
  """
  B, M = new.shape
  V = out.counts.shape[1]
  idx = jnp.arange(M)[None, :]
  is_stop = jnp.any(new[:, :, None] == stop_ids[:, None, :], axis=-1) & (idx < num_new[:, None])
  first_stop = jnp.min(jnp.where(is_stop, idx, M), axis=-1)
  take = jnp.minimum(num_new, first_stop + 1)
  take = jnp.minimum(take, max_tokens - out.num_tokens)
  take = jnp.where(out.done, 0, jnp.maximum(take, 0))
  taken = idx < take[:, None]
  values = jnp.where(taken, new, pad_id)
  write = lambda row, vals, start: jax.lax.dynamic_update_slice_in_dim(row, vals, start, axis=0)
  tokens = jnp.where(out.done[:, None], out.tokens,
                     jax.vmap(write)(out.tokens, values.astype(jnp.int32), out.num_tokens))
  if logprobs is None:
    logprobs = no_logprobs(B, M)
  # Entries past `take` land past num_tokens: never read, overwritten by the next append. Done
  # rows write back what they hold: an [B, M] select, not one over the whole [B, C, N] buffer.
  def put(buf, vals):
    read = lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, M, axis=0)
    held = jax.vmap(read)(buf, out.num_tokens)
    vals = jnp.where(out.done.reshape((B,) + (1,) * (vals.ndim - 1)), held, vals.astype(buf.dtype))
    return jax.vmap(write)(buf, vals, out.num_tokens)
  num = out.num_tokens + take
  done = out.done | (first_stop < take) | (num >= max_tokens)
  counts = out.counts.at[jnp.arange(B)[:, None], jnp.where(taken, new, V)].add(1, mode="drop")
  return Output(tokens=tokens, num_tokens=num, done=done, counts=counts,
                prompt_seen=out.prompt_seen, logprob=put(out.logprob, logprobs.logprob),
                top_ids=put(out.top_ids, logprobs.top_ids),
                top_logprobs=put(out.top_logprobs, logprobs.top_logprobs))


# ----------------------------------------------------------------------------------------------
# Logit transforms
# ----------------------------------------------------------------------------------------------
def needs_adjust(params: SamplingParams) -> jax.Array:
  """Whether any row uses logit_bias, min_tokens or a penalty (else `adjust` is the identity)."""
  return jnp.any((params.presence_penalty != 0) | (params.frequency_penalty != 0)
                 | (params.repetition_penalty != 1) | (params.min_tokens > 0)
                 | jnp.any(params.bias_ids >= 0, axis=-1))


def adjust(logits_btv: jax.Array, params: SamplingParams, out: Output, stop_ids: jax.Array,
           extra: jax.Array | None = None) -> jax.Array:
  """float32 logits [B, T, V] after logit_bias, min_tokens and the penalties.

  Position t of row b follows the row's committed history (out) plus the tokens extra[b, t]
  [B, T, E] (speculative: the drafts accepted before it; -1 = none). Skipped (one cond) when no
  row uses any of them."""
  logits_btv = logits_btv.astype(jnp.float32)

  def apply(logits):
    B, T, V = logits.shape
    rows = jnp.arange(B)[:, None]
    counts = jnp.broadcast_to(out.counts[:, None], (B, T, V))
    generated = jnp.broadcast_to(out.num_tokens[:, None], (B, T))
    if extra is not None:
      counts = counts.at[rows[..., None], jnp.arange(T)[None, :, None],
                         jnp.where(extra >= 0, extra, V)].add(1, mode="drop")
      generated = generated + jnp.sum(extra >= 0, axis=-1)
    bias = jnp.zeros((B, V), jnp.float32).at[
        rows, jnp.where(params.bias_ids >= 0, params.bias_ids, V)].add(params.bias_values,
                                                                         mode="drop")
    logits = logits + bias[:, None]
    is_stop = jnp.zeros((B, V), bool).at[rows, jnp.where(stop_ids >= 0, stop_ids, V)].set(
        True, mode="drop")
    early = generated < params.min_tokens[:, None]
    logits = jnp.where(is_stop[:, None] & early[..., None], -jnp.inf, logits)
    seen = (counts > 0) | out.prompt_seen[:, None]
    r = params.repetition_penalty[:, None, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    logits = (logits - params.frequency_penalty[:, None, None] * counts
              - params.presence_penalty[:, None, None] * (counts > 0))
    return logits

  return jax.lax.cond(needs_adjust(params), apply, lambda l: l, logits_btv)


def adjust_rows(logits: jax.Array, params: SamplingParams, out: Output, stop_ids: jax.Array,
                extra: jax.Array | None = None) -> jax.Array:
  """`adjust` of one position per row: logits [B, V], extra [B, E] or None."""
  return adjust(logits[:, None], params, out, stop_ids,
                None if extra is None else extra[:, None])[:, 0]


def _filter_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Masks to -inf every logit outside the top-k and outside the top-p nucleus (per row)."""
  V = logits.shape[-1]
  desc = -jnp.sort(-logits, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
  in_top_k = jnp.arange(V) < k[:, None]
  probs = jax.nn.softmax(jnp.where(in_top_k, desc, -jnp.inf), axis=-1)
  # A log-depth prefix sum, not jnp.cumsum: jax >= 0.12 lowers cumsum to an HLO `scan`, which
  # XLA:GPU runs as a sequential `while` over the vocabulary (25,256 trips on a TP8 vocab shard)
  # whose body is not a command-buffer command, so every loop around it (the speculative
  # generate loop, even greedy) became host-driven.
  mass_before = jax.lax.associative_scan(jnp.add, probs, axis=-1) - probs
  keep = in_top_k & (mass_before < top_p[:, None])  # the first token is always kept
  n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
  threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
  return jnp.where(logits >= threshold, logits, -jnp.inf)


def _filter_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
  """Keeps tokens with p >= min_p * max p: logit >= max logit + log(min_p)."""
  floor = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
  return jnp.where(logits >= floor, logits, -jnp.inf)


def processed_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Temperature-scaled, min_p/top-k/top-p filtered float32 logits [B, V] (greedy rows:
  unscaled). `logits` are already `adjust`ed (bias, min_tokens, penalties)."""
  logits = logits.astype(jnp.float32)
  temp = jnp.where(params.temperature > 0, params.temperature, 1.0)
  logits = logits / temp[:, None]
  logits = jax.lax.cond(jnp.any(params.min_p > 0), _filter_min_p, lambda l, _: l, logits,
                        params.min_p)
  needs_filter = jnp.any((params.top_k > 0) | (params.top_p < 1.0))
  return jax.lax.cond(needs_filter, _filter_top_k_top_p, lambda l, *_: l,
                      logits, params.top_k, params.top_p)


def probabilities(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """The distribution `sample` draws from: softmax of processed logits, one-hot for greedy rows
  (`logits` already `adjust`ed)."""
  probs = jax.nn.softmax(processed_logits(logits, params), axis=-1)
  greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=probs.dtype)
  return jnp.where((params.temperature > 0)[:, None], probs, greedy)


def any_sampled(params: SamplingParams) -> jax.Array:
  """True when some row samples (temperature > 0): the predicate of every greedy fast path, which
  must give exactly what the general path gives greedy rows (one-hot distributions)."""
  return jnp.any(params.temperature > 0)


def _categorical(keys: jax.Array, log_probs: jax.Array) -> jax.Array:
  return jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, log_probs)


def draw(keys: jax.Array, log_probs: jax.Array, params: SamplingParams) -> jax.Array:
  """A categorical draw per row (row b from keys[b] only), skipped when every row is greedy: then
  each row's distribution is one-hot and its argmax is the draw. Generating B x V random numbers
  per token costs more than a small model's decode step on CPU."""
  return jax.lax.cond(any_sampled(params), lambda: _categorical(keys, log_probs),
                      lambda: jnp.argmax(log_probs, axis=-1)).astype(jnp.int32)


def logprob_lists(logprob, top_ids, top_logprobs, n: int, top: int) -> list:
  """Host arrays of one row ([M], [M, MAX_LOGPROBS] x2) -> the first n tokens' (logprob, [(id,
  logprob)] of the `top` best)."""
  return [(float(logprob[i]), [(int(t), float(v)) for t, v in
                               zip(top_ids[i, :top], top_logprobs[i, :top])]) for i in range(n)]


def any_logprobs(params: SamplingParams) -> jax.Array:
  return jnp.any(params.logprobs >= 0)


def _logprobs_of_adjusted(adjusted_btv: jax.Array, params: SamplingParams,
                          tokens_bt: jax.Array) -> TokenLogprobs:
  B, T, V = adjusted_btv.shape
  per_position = jax.tree.map(lambda x: jnp.repeat(x, T, axis=0), params)
  logp = jax.nn.log_softmax(processed_logits(adjusted_btv.reshape(B * T, V), per_position), -1)
  logp = logp.reshape(B, T, V)
  n = min(MAX_LOGPROBS, V)
  top_lp, top_ids = jax.lax.top_k(logp, n)
  pad = ((0, 0), (0, 0), (0, MAX_LOGPROBS - n))
  return TokenLogprobs(jnp.take_along_axis(logp, tokens_bt[..., None], axis=-1)[..., 0],
                       jnp.pad(top_ids.astype(jnp.int32), pad, constant_values=-1),
                       jnp.pad(top_lp, pad, constant_values=-jnp.inf))


def token_logprobs(logits_btv: jax.Array, params: SamplingParams, out: Output,
                   stop_ids: jax.Array, tokens_bt: jax.Array,
                   extra: jax.Array | None = None) -> TokenLogprobs:
  """Logprobs of tokens [B, T] at positions with raw logits [B, T, V] (history as `adjust`); no
  [B, T, V] work unless some row asked for logprobs."""
  B, T, _ = logits_btv.shape
  return jax.lax.cond(
      any_logprobs(params),
      lambda l: _logprobs_of_adjusted(adjust(l, params, out, stop_ids, extra), params, tokens_bt),
      lambda l: no_logprobs(B, T), logits_btv)


def sample(logits: jax.Array, params: SamplingParams, out: Output,
           stop_ids: jax.Array) -> tuple[jax.Array, TokenLogprobs]:
  """The next token of each row [B] int32 after its history `out`, from the row's own stream at
  token index out.num_tokens, and its logprobs [B, 1] (when some row asked for them)."""
  logits = adjust_rows(logits, params, out, stop_ids)
  greedy = jnp.argmax(logits, axis=-1)
  keys = row_keys(params, out.num_tokens, SALT_SAMPLE)
  drawn = jax.lax.cond(any_sampled(params),
                       lambda: _categorical(keys, processed_logits(logits, params)),
                       lambda: greedy)
  token = jnp.where(params.temperature > 0, drawn, greedy).astype(jnp.int32)
  B = token.shape[0]
  lp = jax.lax.cond(any_logprobs(params),
                    lambda: _logprobs_of_adjusted(logits[:, None], params, token[:, None]),
                    lambda: no_logprobs(B, 1))
  return token, lp
