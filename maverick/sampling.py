"""On-device sampling and stopping, shared by plain generation and speculative decoding.

Sampling parameters are traced per-row arrays, so changing temperature/top-k/top-p never recompiles.
Order as in HF: temperature, then top-k, then top-p. temperature == 0 means greedy for that row.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingParams:
  temperature: jax.Array  # [B] float32, 0 = greedy
  top_k: jax.Array  # [B] int32, 0 = off
  top_p: jax.Array  # [B] float32 in (0, 1], 1 = off

  @classmethod
  def create(cls, batch_size: int, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0) -> "SamplingParams":
    """Validates on the host and broadcasts to [B]."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature >= 0):
      raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
      raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")
    if not (isinstance(top_k, (int, np.integer)) and top_k >= 0):
      raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k}")
    # NumPy then one transfer each: jnp.full or jnp.asarray would compile a program per shape.
    full = lambda v, dt: jax.device_put(np.full((batch_size,), v, dt))
    return cls(full(temperature, np.float32), full(int(top_k), np.int32),
               full(top_p, np.float32))


def _filter_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Masks to -inf every logit outside the top-k and outside the top-p nucleus (per row)."""
  V = logits.shape[-1]
  desc = -jnp.sort(-logits, axis=-1)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
  in_top_k = jnp.arange(V) < k[:, None]
  probs = jax.nn.softmax(jnp.where(in_top_k, desc, -jnp.inf), axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = in_top_k & (mass_before < top_p[:, None])  # the first token is always kept
  n_keep = jnp.maximum(jnp.sum(keep, axis=-1), 1)
  threshold = jnp.take_along_axis(desc, (n_keep - 1)[:, None], axis=-1)
  return jnp.where(logits >= threshold, logits, -jnp.inf)


def processed_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Temperature-scaled, top-k/top-p filtered float32 logits [B, V] (greedy rows: unscaled)."""
  logits = logits.astype(jnp.float32)
  temp = jnp.where(params.temperature > 0, params.temperature, 1.0)
  logits = logits / temp[:, None]
  needs_filter = jnp.any((params.top_k > 0) | (params.top_p < 1.0))
  return jax.lax.cond(needs_filter, _filter_top_k_top_p, lambda l, *_: l,
                      logits, params.top_k, params.top_p)


def probabilities(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """The distribution `sample` draws from: softmax of processed logits, one-hot for greedy rows."""
  probs = jax.nn.softmax(processed_logits(logits, params), axis=-1)
  greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=probs.dtype)
  return jnp.where((params.temperature > 0)[:, None], probs, greedy)


def any_sampled(params: SamplingParams) -> jax.Array:
  """True when some row samples (temperature > 0): the predicate of every greedy fast path, which
  must give exactly what the general path gives greedy rows (one-hot distributions)."""
  return jnp.any(params.temperature > 0)


def draw(key: jax.Array, log_probs: jax.Array, params: SamplingParams) -> jax.Array:
  """jax.random.categorical over the last axis, skipped when every row is greedy: then each row's
  distribution is one-hot and its argmax is the draw. Generating B x V random numbers per token
  costs more than a small model's decode step on CPU."""
  return jax.lax.cond(any_sampled(params), lambda: jax.random.categorical(key, log_probs, axis=-1),
                      lambda: jnp.argmax(log_probs, axis=-1)).astype(jnp.int32)


def sample(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
  """One token per row [B] int32."""
  greedy = jnp.argmax(logits, axis=-1)
  drawn = jax.lax.cond(
      any_sampled(params),
      lambda: jax.random.categorical(key, processed_logits(logits, params), axis=-1),
      lambda: greedy)
  return jnp.where(params.temperature > 0, drawn, greedy).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------
# Stopping: per-row output buffer, counts and done flags
# ----------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Output:
  tokens: jax.Array  # [B, capacity + pad] generated tokens, pad_id after the end
  num_tokens: jax.Array  # [B] int32
  done: jax.Array  # [B] bool


def init_output(batch_size: int, capacity: int, max_append: int, pad_id: int) -> Output:
  # max_append extra columns so a write at the last position never clamps.
  return Output(tokens=jnp.full((batch_size, capacity + max_append), pad_id, jnp.int32),
                num_tokens=jnp.zeros((batch_size,), jnp.int32),
                done=jnp.zeros((batch_size,), bool))


def append(out: Output, new: jax.Array, num_new: jax.Array, stop_ids: jax.Array,
           max_tokens: jax.Array, pad_id: int) -> Output:
  """Appends up to num_new[b] tokens of new [B, M] to each unfinished row.

  A row takes tokens up to and including its first stop token and never more than max_tokens[b] in
  total; then it is done. stop_ids [B, n] is padded with -1.
  """
  B, M = new.shape
  idx = jnp.arange(M)[None, :]
  is_stop = jnp.any(new[:, :, None] == stop_ids[:, None, :], axis=-1) & (idx < num_new[:, None])
  first_stop = jnp.min(jnp.where(is_stop, idx, M), axis=-1)
  take = jnp.minimum(num_new, first_stop + 1)
  take = jnp.minimum(take, max_tokens - out.num_tokens)
  take = jnp.where(out.done, 0, jnp.maximum(take, 0))
  values = jnp.where(idx < take[:, None], new, pad_id)
  write = lambda row, vals, start: jax.lax.dynamic_update_slice_in_dim(row, vals, start, axis=0)
  tokens = jnp.where(out.done[:, None], out.tokens,
                     jax.vmap(write)(out.tokens, values.astype(jnp.int32), out.num_tokens))
  num = out.num_tokens + take
  done = out.done | (first_stop < take) | (num >= max_tokens)
  return Output(tokens=tokens, num_tokens=num, done=done)
