"""Fast losslessness checks of speculative decoding, as plain functions: pytest runs them in
tests/test_spec_lossless.py, scripts/mutation_score.py against each mutant of tests/mutants.py.

References are independent of spec_decode: plain greedy decoding (maverick.generate) and exact
probabilities from the target's logits in float64 NumPy. Every check raises AssertionError on a
mismatch. Inputs (models, references) are built once per process (`prepare()`).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from scipy import stats as scipy_stats

from maverick import model as model_lib
from spec_decode import draft as draft_lib
from spec_decode import speculative as spec

import spec_oracles as so
from test_spec_decode import SMALL, bigram_target_and_oracle_draft

CHAIN_K, TREE = 4, "4x2x8"
N_LONG = 40  # greedy tokens in the teacher's table: more than any row generates
# The teacher tests' target: random weights, real attention over its cache (chunked, NoPE and MoE
# layers); its greedy references build in half the time of the HF fixture's.
TEACHER_CFG = SMALL.replace(vocab_size=128, attention_chunk_size=8)


class TeacherCase:
  """A target that attends over its cache, 4 prompts, their long greedy continuations,
  deliberate teacher errors, per-row stops / limits inside accepted runs, and the plain greedy
  outputs under those stops / limits."""

  def __init__(self, target, check_features=True):
    self.target = target
    rng = np.random.default_rng(0)
    V = target.config.vocab_size
    self.prompts = [rng.integers(1, V, n).tolist() for n in (5, 13, 9, 3)]
    long = so.greedy(target, self.prompts, N_LONG)
    self.seqs = [p + g for p, g in zip(self.prompts, long)]
    # Wrong first proposals every 7th (soft) and 11th (hard) generated token, phases per row.
    soft = [set(range(2 + b, N_LONG, 7)) for b in range(4)]
    hard = [set(range(5 + b, N_LONG, 11)) - soft[b] for b in range(4)]
    absolute = lambda errs: [[len(p) + i for i in e] for p, e in zip(self.prompts, errs)]
    self.soft, self.hard = absolute(soft), absolute(hard)
    clean = lambda b, i: not ({i - 1, i, i + 1} & (soft[b] | hard[b]))

    def stop_at(b, lo):  # a token first seen at generated index i >= lo, inside a clean run
      g = long[b]
      return next(i for i in range(lo, 30) if g[i] not in g[:i] and clean(b, i))

    self.limits = [30, next(i for i in range(9, 30) if clean(1, i - 1)), 30, 24]
    s0, s2 = stop_at(0, 5), stop_at(2, 9)
    self.stops = [[long[0][s0]], [], [long[2][s2], V - 1], []]
    self.want = so.greedy(target, self.prompts, self.limits, stop_tokens=self.stops)
    assert len(self.want[0]) == s0 + 1 and len(self.want[2]) == s2 + 1
    assert len(self.want[1]) == self.limits[1] and len(self.want[3]) == self.limits[3]
    self.draft = so.teacher_draft(target, self.seqs, self.soft, self.hard,
                                  check_features=check_features)
    self.row_drafts = [so.teacher_draft(target, [s], [e], [h], width=64 + N_LONG + 16 - len(s))
                       for s, e, h in zip(self.seqs, self.soft, self.hard)]


@functools.lru_cache(maxsize=None)
def cases():
  return {"teacher": TeacherCase(model_lib.init_model(TEACHER_CFG, seed=5))}


@functools.lru_cache(maxsize=None)
def fp8_case():
  """The same target with an FP8 KV cache (its features differ from a cache-free forward, so the
  teacher checks tokens and positions only)."""
  from maverick import quant
  target = quant.quantize_model(model_lib.init_model(TEACHER_CFG, seed=5),
                                quant.QuantConfig(weights=None, kv_cache="fp8"))
  return TeacherCase(target, check_features=False)


def _shape(mode):
  return dict(k=CHAIN_K) if mode == "chain" else dict(tree=TREE)


def teacher_greedy(mode: str, batch: int, case=None):
  """Greedy speculative output with the teacher draft == plain greedy output, with stops in the
  middle of accepted runs and limits that cut one; > 2 tokens per round. Batch 1 runs each row
  alone and must also give that row's batch-4 acceptance statistics (a finished row counts
  nothing, whatever the other rows do)."""
  c = case or cases()["teacher"]
  out = spec.generate(c.target, c.draft, c.prompts, max_new_tokens=c.limits,
                      stop_tokens=c.stops, **_shape(mode))
  assert out.tokens == c.want, (mode, out.tokens, c.want)
  assert out.acceptance_length > 2, (mode, out.acceptance_length)
  if batch == 1:
    for b in range(len(c.prompts)):
      one = spec.generate(c.target, c.row_drafts[b], [c.prompts[b]], max_new_tokens=c.limits[b],
                          stop_tokens=[c.stops[b]], **_shape(mode))
      assert one.tokens == [c.want[b]], (mode, b, one.tokens, c.want[b])
      assert (one.rounds[0], one.accepted[0]) == (out.rounds[b], out.accepted[b]), (mode, b)
      np.testing.assert_array_equal(one.accepted_at[0], out.accepted_at[b])


# ---------------------------------------------------------------------------------------------
# Sampling: chi-squared tests against exact float64 distributions
# ---------------------------------------------------------------------------------------------
SAMPLE_PROMPT, N_TOK, ROWS, CALLS = [3, 11, 7], 4, 4000, 2
SAMPLING = {"temp": dict(temperature=1.0), "top_p": dict(temperature=1.0, top_p=0.8)}
# Logit transforms that read the history (the drafts accepted before a position count too).
ADJUSTED = {
    "penalties": dict(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.6,
                      repetition_penalty=1.8, logit_bias={3: 1.5, 11: -2.0, 20: 1.0}),
    "min_p_bias": dict(temperature=0.8, min_p=0.12, logit_bias={5: 2.5, 7: -1.0}),
}
CHI2_CHAIN_K, CHI2_TREE = 2, "2x3x6"  # N_TOK >= K + 2 / depth + 2: token 3 can be a bonus
P_FAIL = 1e-3


def _near_oracle_pair():
  """A target that attends over its cache (random attention outputs added to a bigram model) and a
  draft that reproduces the bigram part: proposals are often, not always, accepted at depth."""
  target, draft = bigram_target_and_oracle_draft(3, SMALL)
  target.lm_head[...] = target.lm_head[...] * 4.0
  draft.lm_head[...] = target.lm_head[...]
  donor = model_lib.init_model(SMALL, seed=9)
  for layer, src in zip(target.layers, donor.layers):
    layer.attn.o[...] = src.attn.o[...] * 0.25
  return target, draft


def _flat_subvocab_draft(oracle, size=16):
  """The oracle on a random subset of the vocabulary (ids mapped by d2t) with flattened logits:
  q differs from p, so rejections and residual draws are common."""
  used = np.sort(np.random.default_rng(5).choice(SMALL.vocab_size, size, replace=False))
  draft = draft_lib.init_draft(draft_lib.Eagle3Config.for_target(SMALL, draft_vocab_size=size), 0)
  for name in ("fc", "embed_norm", "hidden_norm", "layer", "final_norm"):
    setattr(draft, name, getattr(oracle, name))
  draft.lm_head[...] = oracle.lm_head[...][:, used] * 0.5
  draft.d2t[...] = jnp.asarray(used - np.arange(size), jnp.int32)
  return draft


class SamplingCase:

  def __init__(self):
    self.target, self.tree_draft = _near_oracle_pair()
    self.chain_draft = _flat_subvocab_draft(self.tree_draft)
    self.exact = {name: so.exact_joint(self.target, SAMPLE_PROMPT, N_TOK, **filt)
                  for name, filt in SAMPLING.items()}
    self._adjusted = {}

  def exact_of(self, setting):
    if setting in self.exact:
      return self.exact[setting]
    if setting not in self._adjusted:  # built on first use: the mutation runs never need them
      self._adjusted[setting] = so.exact_joint(self.target, SAMPLE_PROMPT, N_TOK,
                                               **ADJUSTED[setting])
    return self._adjusted[setting]


@functools.lru_cache(maxsize=None)
def sampling_case():
  return SamplingCase()


def chi2_pvalue(counts, probs, min_expected=5.0):
  """Pearson chi-squared p-value; cells expected below min_expected are pooled into one. Counts in
  a cell of probability 0 give p = 0."""
  counts, probs = np.ravel(counts), np.ravel(probs)
  n = counts.sum()
  if counts[probs <= 1e-12].sum() > 0:
    return 0.0
  small = n * probs < min_expected
  obs = np.append(counts[~small], counts[small].sum())
  exp = np.append(n * probs[~small], n * probs[small].sum())
  keep = exp > 0
  chi2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
  return float(scipy_stats.chi2.sf(chi2, keep.sum() - 1))


def sampled_distribution(mode: str, setting: str):
  """CALLS x ROWS rows of N_TOK sampled tokens; chi-squared tests of each token's marginal and of
  the joint of each consecutive pair (tokens 2, 3 cover a bonus after a fully accepted round)
  against the exact distribution. Drafts must be accepted at the last draft position."""
  c = sampling_case()
  target, draft = c.target, getattr(c, f"{mode}_draft")
  shape = dict(k=CHI2_CHAIN_K) if mode == "chain" else dict(tree=CHI2_TREE)
  toks, last_level = [], []
  for seed in range(CALLS):
    out = spec.generate(target, draft, [SAMPLE_PROMPT] * ROWS, max_new_tokens=N_TOK,
                        stop_tokens=[], seed=seed, **shape, **{**SAMPLING, **ADJUSTED}[setting])
    toks.append(np.asarray(out.tokens))
    last_level.append(out.acceptance_rates[-1])
  toks = np.concatenate(toks)
  joint = c.exact_of(setting)
  V = SMALL.vocab_size
  axes = tuple(range(N_TOK))
  pvals = {}
  for t in range(N_TOK):
    pvals[f"t{t}"] = chi2_pvalue(np.bincount(toks[:, t], minlength=V),
                                 joint.sum(tuple(a for a in axes if a != t)))
  for t in range(N_TOK - 1):
    pair = np.bincount(toks[:, t] * V + toks[:, t + 1], minlength=V * V)
    pvals[f"t{t},t{t + 1}"] = chi2_pvalue(pair, joint.sum(tuple(a for a in axes
                                                                if a not in (t, t + 1))))
  bad = {k: p for k, p in pvals.items() if p < P_FAIL}
  assert not bad, (mode, setting, bad)
  assert np.mean(last_level) > 0.1, (mode, setting, last_level)
  return pvals, float(np.mean(last_level))


def fp8_tree_commit():
  """The NumPy-referenced unit test of commit_path on an FP8 cache (entries and scales move), then
  the teacher tree run on an FP8-cache target (partial paths through siblings get committed)."""
  from test_tree import test_commit_path_moves_fp8_scales_with_their_entries
  test_commit_path_moves_fp8_scales_with_their_entries()
  teacher_greedy("tree", 4, fp8_case())


def _np_greedy_chain(best, tokens):
  """The rejection rule on one-hot p and q, by hand: accepted = the leading run of candidates
  equal to the target's argmax at their position; next = the argmax after the run."""
  n = np.zeros(len(tokens), np.int64)
  for b in range(len(tokens)):
    while n[b] < tokens.shape[1] and tokens[b, n[b]] == best[b, n[b]]:
      n[b] += 1
  return n, best[np.arange(len(tokens)), n]


# A fixed verify-block tree: index -> parent (root 0 has none); depth from the parents.
_TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 6, 7]


def _np_greedy_tree(best, tokens, parents, depths, max_depth):
  n, nxt, paths = [], [], []
  for b in range(len(tokens)):
    cur, path = 0, [0]
    for level in range(1, max_depth + 1):
      kids = [i for i in range(tokens.shape[1]) if parents[b, i] == cur and depths[b, i] == level
              and tokens[b, i] == best[b, cur]]
      if not kids:
        break
      cur = kids[0]
      path.append(cur)
    n.append(len(path) - 1)
    nxt.append(best[b, cur])
    paths.append(path + [0] * (max_depth + 1 - len(path)))
  return np.array(n), np.array(nxt), np.array(paths)


def greedy_rules():
  """The greedy fast paths of chain and tree verification equal a NumPy walk of the rule AND the
  general rejection sampler run on the same greedy rows, on random logits where candidates
  match their position's argmax independently (so matches after a mismatch occur)."""
  from maverick import sampling
  from spec_decode import tree as tree_lib
  from spec_decode import verify as verify_lib
  import jax
  rng = np.random.default_rng(11)
  B, K, V = 64, 4, 40
  greedy = sampling.SamplingParams.create(B)
  history = sampling.empty_output(B, V)
  no_stop = jnp.full((B, 1), -1, jnp.int32)
  logits = rng.standard_normal((B, K + 1, V)).astype(np.float32)
  best = logits.argmax(-1)
  wrong = (best + rng.integers(1, V, best.shape)) % V
  tokens = np.where(rng.random((B, K)) < 0.6, best[:, :K], wrong[:, :K]).astype(np.int32)
  cand = verify_lib.Candidates(jnp.asarray(tokens), jnp.asarray(np.eye(V, dtype=np.float32)[tokens]),
                               verify_lib.chain_parents(K))
  want = _np_greedy_chain(best, tokens)
  assert 0 < (want[0] == 0).sum() < B and (want[0] == K).any(), "the case must mix run lengths"
  fast = verify_lib.verify_chain(jnp.asarray(logits), cand, greedy, history, no_stop)
  general = verify_lib.verify_chain_sampled(jnp.asarray(logits), cand, greedy, history.num_tokens)
  for name, got in (("fast", fast), ("general", general)):
    np.testing.assert_array_equal(np.asarray(got[0]), want[0], err_msg=f"chain n ({name})")
    np.testing.assert_array_equal(np.asarray(got[1]), want[1], err_msg=f"chain next ({name})")

  T = len(_TREE_PARENTS)
  parents = np.broadcast_to(np.array(_TREE_PARENTS, np.int32), (B, T)).copy()
  depths = np.zeros((B, T), np.int32)
  for i in range(1, T):
    depths[:, i] = depths[:, _TREE_PARENTS[i]] + 1
  max_depth = int(depths.max())
  logits = rng.standard_normal((B, T, V)).astype(np.float32)
  best = logits.argmax(-1)
  tokens = np.zeros((B, T), np.int32)
  for b in range(B):
    for p in range(T):
      kids = [i for i in range(T) if _TREE_PARENTS[i] == p]
      if not kids:
        continue
      # Siblings are distinct tokens; at most one of them is the parent's argmax.
      choices = rng.permutation([t for t in range(V) if t != best[b, p]])[:len(kids)]
      if rng.random() < 0.7:
        choices[rng.integers(len(kids))] = best[b, p]
      tokens[b, kids] = choices
  want = _np_greedy_tree(best, tokens, parents, depths, max_depth)
  assert len(set(want[0].tolist())) > 2, "the case must mix path lengths"
  args = tuple(jnp.asarray(x) for x in (logits, tokens, parents, depths))
  ancestors = tree_lib.verify_layout(
      tree_lib.TreeCandidates(args[1][:, 1:], args[2][:, 1:] - 1, args[3][:, 1:], args[0][..., 0]),
      max_depth)[2]
  fast = tree_lib.verify_tree(*args, ancestors, greedy, history, no_stop, max_depth)
  general = tree_lib.verify_tree_sampled(*args, greedy, history.num_tokens, max_depth=max_depth)
  for name, got in (("fast", fast), ("general", general)):
    for i, what in enumerate(("n", "next", "path")):
      np.testing.assert_array_equal(np.asarray(got[i]), want[i], err_msg=f"tree {what} ({name})")


# The fast checks by name, cheapest first within each kind (mutation runs try them in order).
CHECKS = {
    "greedy rules": greedy_rules,
    "teacher chain b4": lambda: teacher_greedy("chain", 4),
    "teacher tree b4": lambda: teacher_greedy("tree", 4),
    "teacher chain b1": lambda: teacher_greedy("chain", 1),
    "teacher tree b1": lambda: teacher_greedy("tree", 1),
    "fp8 tree commit": fp8_tree_commit,
    **{f"chi2 {mode} {setting}": functools.partial(sampled_distribution, mode, setting)
       for mode in ("chain", "tree") for setting in SAMPLING},
    **{f"chi2 {mode} {setting}": functools.partial(sampled_distribution, mode, setting)
       for mode in ("chain", "tree") for setting in ADJUSTED},
}


def prepare():
  """Builds every reference before any mutant is applied."""
  cases()
  sampling_case()
  # fp8_case() is built on first use: only mutants that pass the commit_path unit test reach it,
  # and mutants touch spec_decode only, never the plain greedy reference.
