"""Drafting and lossless verification of a speculative round.

A drafter returns `Candidates`: tokens, the draft's TRUE probabilities q for each (already lifted into
the target vocabulary) and each candidate's parent, so a tree drafter can replace the chain without
touching verification. The verifier implements the standard rejection rule: accept candidate x with
probability min(1, p(x)/q(x)); on the first rejection sample from norm(max(0, p - q)); if all are
accepted sample the bonus token from p. p and q are processed with the same temperature / top-k / top-p
as plain generation (`maverick.sampling.probabilities`), after the same logit_bias, min_tokens and
penalties (`maverick.sampling.adjust`), which at draft position j see the committed history plus the
drafts before j. Greedy rows have one-hot p and q, for which
the rule reduces exactly to "longest prefix equal to the target argmax, plus the target's next token".
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from maverick import sampling


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Candidates:
  tokens: jax.Array  # [B, K] target-vocabulary ids
  probs: jax.Array  # [B, K, V] draft distribution each token was drawn from
  parents: jax.Array  # [K] int32, parent candidate index (-1 = the round's root token)


def chain_parents(k: int) -> jax.Array:
  return jnp.arange(k, dtype=jnp.int32) - 1


def _row_params(params: sampling.SamplingParams, reps: int) -> sampling.SamplingParams:
  return jax.tree.map(lambda x: jnp.repeat(x, reps, axis=0), params)


def target_probabilities(logits_btv: jax.Array, params: sampling.SamplingParams) -> jax.Array:
  """p for every position [B, T, V] of `adjust`ed logits with per-row sampling parameters."""
  B, T, V = logits_btv.shape
  p = sampling.probabilities(logits_btv.reshape(B * T, V), _row_params(params, T))
  return p.reshape(B, T, V)


def chain_history(tokens: jax.Array) -> jax.Array:
  """[B, K] drafts -> [B, K+1, K]: at verify position j the drafts before it (-1 elsewhere)."""
  K = tokens.shape[1]
  before = jnp.arange(K)[None, :] < jnp.arange(K + 1)[:, None]
  return jnp.where(before[None], tokens[:, None, :], -1)


def verify_chain(logits_btv: jax.Array, cand: Candidates, params: sampling.SamplingParams,
                 result: sampling.Output, stop_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Target logits at [root, c_1..c_K] -> (accepted count n [B] in 0..K, next token [B]).

  result: the rows' committed history (penalty counts, and the token index that keys the rows'
  random streams). The next token is the correction sampled from the residual at position n when
  n < K, or the bonus sampled from p_K when every candidate was accepted. When every row is greedy
  no [B, K, V] distribution is built (a GPU launches each of those ops inside the loop).
  """
  logits_btv = sampling.adjust(logits_btv, params, result, stop_ids, chain_history(cand.tokens))
  return jax.lax.cond(sampling.any_sampled(params), verify_chain_sampled, verify_chain_greedy,
                      logits_btv, cand, params, result.num_tokens)


def verify_chain_greedy(logits_btv, cand: Candidates, params, index):
  """The rejection rule for one-hot p and q: the longest prefix equal to the target's argmax,
  then the target's argmax after it (the correction, or the bonus when all K match)."""
  K = cand.tokens.shape[1]
  best = jnp.argmax(logits_btv, axis=-1).astype(jnp.int32)  # [B, K+1]
  match = (cand.tokens == best[:, :K]).astype(jnp.int32)
  n = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
  return n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]


def verify_chain_sampled(logits_btv, cand: Candidates, params, index):
  B, K = cand.tokens.shape
  V = logits_btv.shape[-1]
  p = target_probabilities(logits_btv, params)  # [B, K+1, V]
  p_draft = jnp.take_along_axis(p[:, :K], cand.tokens[..., None], axis=-1)[..., 0]
  q_draft = jnp.take_along_axis(cand.probs, cand.tokens[..., None], axis=-1)[..., 0]
  u = sampling.uniform(sampling.row_keys(params, index, sampling.SALT_ACCEPT), K)
  accept = u * q_draft < p_draft  # u < p/q without dividing; q(x) > 0 since x was drawn from q
  n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
  p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]
  q_pad = jnp.concatenate([cand.probs, jnp.zeros((B, 1, V), cand.probs.dtype)], axis=1)
  q_n = jnp.take_along_axis(q_pad, n[:, None, None], axis=1)[:, 0]
  residual = jnp.maximum(p_n - q_n, 0.0)
  # p == q leaves nothing to correct with (then rejection had probability 0): fall back to p.
  residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_n)
  nxt = sampling.draw(sampling.row_keys(params, index, sampling.SALT_RESIDUAL), jnp.log(residual),
                      params)
  return n.astype(jnp.int32), nxt
