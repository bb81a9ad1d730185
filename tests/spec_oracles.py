"""Independent references for the speculative decoding tests (no spec_decode code computes them).

TeacherDraft: a draft whose proposals are a precomputed greedy continuation, looked up from what the
loop feeds it (position, token, fused target feature). It proposes the greedy token at p+2 when it
is fed the greedy token at p+1 (and, on a target-feature step, the target's feature at p), with
deliberate errors at chosen positions ("soft": the wrong token on top, the right one second, so a
tree can still hold it as a sibling; "hard": two wrong tokens, so a tree misses too), and a flat
distribution whenever its input is off. It writes each token it is fed into its KV cache slot and
requires the whole history there to be the greedy sequence too. A loop that commits the wrong
length, feeds the wrong position, token or feature, or fills the draft cache wrong, therefore loses
acceptance or output.

Exact sampling references come from the target's logits in float64 NumPy, by enumeration.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maverick import generation as plain
from maverick import model as model_lib
from maverick.model import token_positions
from spec_decode import draft as draft_lib

TOP, SECOND = 10.0, 7.0  # teacher logits: proposal, and the right token under a deliberate error


class TeacherDraft(draft_lib.Eagle3Draft):
  """Eagle3Draft with the decoder replaced by table lookups; its KV cache records the tokens fed."""

  def __call__(self, tokens_bt, hidden_btd, embed_vd, positions_bt=None, cache=None, *,
               prefill=False, logits_at=None, attention_fn=None, tree=None):
    B, T = tokens_bt.shape
    pos, _ = token_positions(tokens_bt, positions_bt, cache, prefill, tree)
    seq, err = self.seq[...], self.err[...]
    S, V = seq.shape[1], self.config.draft_vocab_size
    at = lambda tbl, i: jnp.take_along_axis(tbl, jnp.clip(i, 0, S - 1), axis=1)
    ok = at(seq, pos + 1) == tokens_bt
    # The draft cache as a token history: slot s holds the token fed at slot s (k[..., 0, 0]).
    hist = cache.k[0][:, :, 0, 0]
    C = hist.shape[1]
    slots = cache.lengths[:, None] + jnp.arange(T)[None]
    hist = hist.at[jnp.arange(B)[:, None], slots].set(tokens_bt.astype(hist.dtype), mode="drop")
    if tree is None:  # tree steps write frontier nodes past the history: no check there
      bad = jnp.cumsum(hist != at(seq, jnp.arange(C)[None] + 1).astype(hist.dtype), axis=1)
      ok &= (pos == 0) | (jnp.take_along_axis(bad, jnp.clip(pos - 1, 0, C - 1), axis=1) == 0)
    if self.check_features and (prefill or (tree is None and T >= 2)):  # a target-feature step
      want = jnp.take_along_axis(self.feat[...], jnp.clip(pos, 0, S - 1)[..., None], axis=1)
      scale = 1.0 + jnp.max(jnp.abs(want), -1)
      ok &= jnp.max(jnp.abs(hidden_btd - want), -1) <= 1e-3 * scale
    nxt, wrong = at(seq, pos + 2), at(err, pos + 2)
    ok &= nxt >= 0
    top = jnp.where(wrong > 0, (nxt + 1) % V, nxt)
    second = jnp.where(wrong == 1, nxt, (nxt + 2) % V)
    logits = (TOP * jax.nn.one_hot(top, V)
              + SECOND * jax.nn.one_hot(second, V) * (wrong > 0)[..., None])
    logits = jnp.where(ok[..., None], logits, 0.0)
    hidden = hidden_btd.astype(jnp.float32)
    if logits_at is not None:
      pick = lambda x: jnp.take_along_axis(x, logits_at[:, None, None].astype(jnp.int32), 1)[:, 0]
      logits, hidden = pick(logits), pick(hidden)
    k0 = cache.k[0].at[:, :, 0, 0].set(hist)
    new_cache = dataclasses.replace(cache, k=(k0,) + tuple(cache.k[1:]), lengths=cache.lengths + T)
    return draft_lib.DraftOutput(logits=logits, hidden=hidden, cache=new_cache)


def teacher_draft(target, seqs, soft, hard, *, check_features=True, width=64):
  """seqs[b]: prompt + greedy continuation of row b; soft[b] / hard[b]: absolute positions where the
  teacher proposes a wrong token first (soft: the right one second). Tables are -1 past the
  sequence (flat proposals)."""
  cfg = draft_lib.Eagle3Config.for_target(target.config)
  draft = TeacherDraft(cfg, nnx.Rngs(params=0))
  B, S = len(seqs), max(map(len, seqs)) + width
  seq = np.full((B, S), -1, np.int32)
  err = np.zeros((B, S), np.int32)
  for b, s in enumerate(seqs):
    seq[b, :len(s)] = s
    err[b, [p for p in soft[b] if p < S]] = 1
    err[b, [p for p in hard[b] if p < S]] = 2
  draft.seq = draft_lib.Buffer(jnp.asarray(seq))
  draft.err = draft_lib.Buffer(jnp.asarray(err))
  draft.check_features = bool(check_features)
  # The target's EAGLE-3 features along each greedy sequence, fused by the draft's fc: what the loop
  # must feed at each position (one plain forward, no cache).
  tokens = jnp.asarray(np.maximum(seq, 0))
  hidden = model_lib.apply(*nnx.split(target), tokens, capture_layers=cfg.aux_layer_ids).hidden
  feats = jnp.concatenate(list(hidden), axis=-1)
  draft.feat = draft_lib.Buffer(draft.fuse(feats).astype(jnp.float32))
  return draft


def greedy(target, prompts, n, **kw):
  return plain.generate(target, prompts, max_new_tokens=n, **{"stop_tokens": [], **kw}).tokens


# ---------------------------------------------------------------------------------------------
# Exact distributions (float64 NumPy on the target's logits)
# ---------------------------------------------------------------------------------------------
def filtered_probs(logits, temperature, top_k=0, top_p=1.0):
  """HF order: temperature, top-k, then top-p (the smallest set reaching top_p; ties kept)."""
  z = np.asarray(logits, np.float64) / temperature
  if top_k:
    kth = np.sort(z, -1)[..., -top_k][..., None]
    z = np.where(z < kth, -np.inf, z)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  if top_p < 1.0:
    desc = -np.sort(-p, -1)
    before = np.cumsum(desc, -1) - desc
    n_keep = np.maximum((before < top_p).sum(-1), 1)
    thresh = np.take_along_axis(desc, (n_keep - 1)[..., None], -1)
    p = np.where(p >= thresh, p, 0.0)
    p /= p.sum(-1, keepdims=True)
  return p


def adjusted_probs(logits, prompt, generated, temperature, top_k=0, top_p=1.0, min_p=0.0,
                   presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                   logit_bias=None, min_tokens=0, stop=()):
  """Row n [N, V]: the sampled distribution after prompt + generated[n] ([N, G] ids), by vLLM's
  definitions: logit_bias added; stop ids masked while fewer than min_tokens were generated;
  repetition penalty on prompt + generated tokens (positive logits divided, negative multiplied);
  frequency (x count) and presence (x [count > 0]) penalties on generated tokens; then
  temperature (0 = one-hot argmax), min_p (p < min_p * max p removed), top-k, top-p."""
  z = np.array(logits, np.float64)
  N, V = z.shape
  for t, bias in (logit_bias or {}).items():
    z[:, t] += bias
  generated = np.asarray(generated, np.int64).reshape(N, -1)
  if generated.shape[1] < min_tokens:
    z[:, list(stop)] = -np.inf
  counts = np.zeros((N, V))
  for col in generated.T:
    counts[np.arange(N), col] += 1
  seen = counts > 0
  seen[:, list(prompt)] = True
  r = repetition_penalty
  z = np.where(seen, np.where(z > 0, z / r, z * r), z)
  z = z - frequency_penalty * counts - presence_penalty * (counts > 0)
  if temperature == 0:
    return np.eye(V)[z.argmax(-1)]
  z = z / temperature
  if min_p:
    p = np.exp(z - z.max(-1, keepdims=True))
    z = np.where(p < min_p * p.max(-1, keepdims=True), -np.inf, z)
  return filtered_probs(z, 1.0, top_k, top_p)


def exact_joint(target, prompt, n_tokens, **options):
  """Exact distribution of the first n_tokens generated tokens: array [V] * n_tokens (n <= 4),
  by enumerating every continuation through plain forwards of the target (`adjusted_probs`)."""
  V = target.config.vocab_size
  graphdef, state = nnx.split(target)
  seqs, probs = np.asarray([prompt]), np.ones(1)
  for _ in range(n_tokens):
    logits = np.asarray(model_lib.apply(graphdef, state, jnp.asarray(seqs)).logits[:, -1])
    joint = probs[:, None] * adjusted_probs(logits, prompt, seqs[:, len(prompt):], **options)
    seqs = np.concatenate([np.repeat(seqs, V, 0), np.tile(np.arange(V), len(seqs))[:, None]], 1)
    probs = joint.reshape(-1)
  return probs.reshape((V,) * n_tokens)
