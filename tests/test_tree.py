"""EAGLE-2 tree drafting: tree-masked attention, draft scores, lossless greedy and sampling,
on-device loop, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maverick import generation as plain
from maverick import kv_cache as kvc
from maverick import model as model_lib
from spec_decode import draft as draft_lib
from spec_decode import speculative as spec
from spec_decode import tree as tree_lib
from spec_decode.tree import TreeShape
from test_generate import count_compiles
from test_model import EXTRA_CONFIGS
from test_spec_decode import (SMALL, _prompts, assert_greedy_lossless,
                              bigram_target_and_oracle_draft, sample_and_check_marginals)

SHAPES = ["3x2x5", "4x3x10", "5x4x16"]


@pytest.fixture(scope="module")
def random_draft(fixture_model):
  return draft_lib.init_draft(draft_lib.Eagle3Config.for_target(fixture_model.config), seed=1)


def _apply(model, *args, **kw):
  return model_lib.apply(*nnx.split(model), *args, **kw)


def _recompute_last(model, seqs):
  """Logits after the last token of each sequence, from one plain right-padded forward."""
  batch = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
  for b, s in enumerate(seqs):
    batch[b, :len(s)] = s
  logits = np.asarray(_apply(model, jnp.asarray(batch)).logits)
  return np.stack([logits[b, len(s) - 1] for b, s in enumerate(seqs)])


# A verify block: index 0 is the root; parents before children; depths up to 4.
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 6, 3, 8]


def _path(j):
  path = [j]
  while PARENTS[path[-1]] >= 0:
    path.append(PARENTS[path[-1]])
  return path[::-1]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["fixture", "temp_tuning"])
def test_tree_mask_forward_equals_recompute_of_each_path(fixture_model, which):
  """Every node's logits under the tree mask == a plain forward over prompt + its root path, with
  the tree crossing a chunk boundary; then committing one path's KV == having decoded it."""
  model = fixture_model if which == "fixture" else model_lib.init_model(
      EXTRA_CONFIGS["temp_tuning_no_qknorm_nope2_dense_rope"], seed=7)
  V = model.config.vocab_size
  rng = np.random.default_rng(11)
  T = len(PARENTS)
  depth = np.array([len(_path(j)) - 1 for j in range(T)])
  anc = np.array([[i in _path(j) for i in range(T)] for j in range(T)])
  lens = [13, 15]  # tree positions 13..17 and 15..19 cross the chunk boundary at 16 (and 8)
  prompts = [rng.integers(0, V, n).tolist() for n in lens]
  tokens = rng.integers(0, V, (2, T)).astype(np.int32)
  cache = kvc.KVCache.init(model.config, 2, 48)
  padded = np.zeros((2, max(lens)), np.int32)
  for b, p in enumerate(prompts):
    padded[b, :len(p)] = p
  cache = _apply(model, jnp.asarray(padded), cache=cache, prefill=True).cache
  L = jnp.asarray(lens, jnp.int32)
  positions = L[:, None] + jnp.asarray(depth)[None]
  tree = model_lib.TreeMask(start=L, positions=positions,
                            visible=jnp.broadcast_to(jnp.asarray(anc), (2, T, T)))
  out = _apply(model, jnp.asarray(tokens), positions, cache.with_lengths(L), tree=tree)
  logits = np.asarray(out.logits)
  scale = np.abs(logits).max()
  ref = _recompute_last(model, [prompts[b] + tokens[b, _path(j)].tolist()
                                for b in range(2) for j in range(T)])
  np.testing.assert_allclose(logits.reshape(2 * T, -1), ref, atol=1e-5 * scale, rtol=0)
  # Commit path root->6->7... (row 0) and root->2->5 (row 1), then decode one token after it.
  paths = [_path(7), _path(5)]
  width = max(map(len, paths))
  path = jnp.asarray([p + [0] * (width - len(p)) for p in paths], jnp.int32)
  committed = tree_lib.commit_path(out.cache, L, path)
  nxt = rng.integers(0, V, (2, 1)).astype(np.int32)
  after = L + jnp.asarray([len(p) for p in paths], jnp.int32)
  dec = np.asarray(_apply(model, jnp.asarray(nxt), cache=committed.with_lengths(after)).logits)
  ref = _recompute_last(model, [prompts[b] + tokens[b, paths[b]].tolist() + [int(nxt[b, 0])]
                                for b in range(2)])
  np.testing.assert_allclose(dec[:, 0], ref, atol=1e-5 * scale, rtol=0)


@pytest.mark.slow
def test_draft_tree_scores_are_path_log_probs(fixture_model):
  """Each node's score == the sum of draft log-probs along its path, computed by plain single-token
  draft steps (no tree mask); parents come before children and siblings are distinct."""
  shape = TreeShape(4, 3, 10)
  draft = draft_lib.init_draft(draft_lib.Eagle3Config.for_target(fixture_model.config), seed=2)
  draft.lm_head[...] = draft.lm_head[...] * 30.0  # peaked distributions: deep levels get kept
  embed = fixture_model.embed[...]
  V = fixture_model.config.vocab_size
  D = fixture_model.config.hidden_size
  rng = np.random.default_rng(3)
  B, P = 2, 9
  toks = jnp.asarray(rng.integers(0, V, (B, P)), jnp.int32)
  feats = jnp.asarray(rng.normal(size=(B, P, 3 * D)), jnp.float32)
  lens = jnp.asarray([9, 6], jnp.int32)
  dout = draft(toks, draft.fuse(feats), embed, cache=draft.init_cache(B, 64), prefill=True,
               logits_at=lens - 1)
  dcache = dout.cache.with_lengths(lens)
  cand, _ = jax.jit(lambda lg, h, c, n: tree_lib.draft_tree(draft, lg, h, c, n, embed, shape))(
      dout.logits, dout.hidden, dcache, lens)
  tokens, parents, depths, scores = (np.asarray(x) for x in
                                     (cand.tokens, cand.parents, cand.depths, cand.scores))
  for b in range(B):
    row = lambda x: jax.tree.map(lambda a: a[b:b + 1], x)
    assert depths[b].max() >= 3 and depths[b].max() <= shape.depth
    for j in range(shape.nodes):
      path, n = [j], j
      while parents[b, n] >= 0:
        assert parents[b, n] < n and depths[b, parents[b, n]] == depths[b, n] - 1
        n = parents[b, n]
        path.append(n)
      assert depths[b, path[-1]] == 1
      path = path[::-1]
      logits, hidden, cache = row(dout.logits), row(dout.hidden), row(dcache)
      total = 0.0
      for i, node in enumerate(path):
        total += float(jax.nn.log_softmax(logits[0])[tokens[b, node]])
        if i + 1 < len(path):
          out = draft(jnp.asarray([[tokens[b, node]]]), hidden[:, None], embed,
                      cache=cache.with_lengths(lens[b:b + 1] + i))
          logits, hidden, cache = out.logits[:, 0], out.hidden[:, 0], out.cache
      np.testing.assert_allclose(scores[b, j], total, atol=1e-4, rtol=1e-5)
    for p in set(parents[b]):
      sib = tokens[b][parents[b] == p]
      assert len(set(sib.tolist())) == len(sib)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHAPES)
def test_greedy_lossless_with_random_draft(fixture_model, random_draft, shape):
  """>= 50 prompts, batch 4 and batch 1: tree output == plain greedy output."""
  assert_greedy_lossless(fixture_model, random_draft, _prompts(52, seed=len(shape)), tree=shape)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["3x2x10", "4x2x14"])
def test_oracle_draft_accepts_a_full_path_every_round(shape):
  """With every candidate kept (nodes == topk + (depth-1) topk^2) the oracle's path is in the
  tree, so each round accepts `depth` drafts: exercises deep verification and path commits."""
  target, draft = bigram_target_and_oracle_draft()
  prompts = [[5, 17, 300, 22], [7] * 9, list(range(40, 70)), [1]]
  kw = dict(max_new_tokens=24, stop_tokens=[])
  out = spec.generate(target, draft, prompts, tree=shape, **kw)
  assert out.tokens == plain.generate(target, prompts, **kw).tokens
  depth = TreeShape.parse(shape).depth
  assert out.acceptance_length > depth + 1 - 0.5
  np.testing.assert_allclose(out.acceptance_rates, 1.0, atol=0.15)


def _peaked_oracle_pair(draft_vocab):
  """SMALL-config bigram target with sharpened logits and its oracle draft, optionally restricted
  to a random subset of `draft_vocab` ids: deep levels and siblings get accepted often."""
  target, oracle = bigram_target_and_oracle_draft(3, SMALL)
  target.lm_head[...] = target.lm_head[...] * 4.0
  if draft_vocab == SMALL.vocab_size:
    oracle.lm_head[...] = target.lm_head[...]
    return target, oracle
  used = np.sort(np.random.default_rng(5).choice(SMALL.vocab_size, draft_vocab, replace=False))
  draft = draft_lib.init_draft(
      draft_lib.Eagle3Config.for_target(SMALL, draft_vocab_size=draft_vocab), seed=0)
  for name in ("fc", "embed_norm", "hidden_norm", "layer", "final_norm"):
    setattr(draft, name, getattr(oracle, name))
  draft.lm_head[...] = target.lm_head[...][:, used]
  draft.d2t[...] = jnp.asarray(used - np.arange(draft_vocab), jnp.int32)
  return target, draft


@pytest.mark.slow
@pytest.mark.parametrize("draft_vocab,top_k,shape", [(24, 0, "3x3x12"), (16, 8, "3x2x10")])
def test_sampling_distribution_matches_target(draft_vocab, top_k, shape):
  """Chi-squared test of 20k sampled tokens per position against the exact target marginals."""
  target, draft = _peaked_oracle_pair(draft_vocab)
  outs = sample_and_check_marginals(target, draft, 1.5, top_k, tree=shape)
  # Second-level nodes are accepted often: the walk is exercised beyond the first level.
  assert np.mean([o.acceptance_rates for o in outs], 0)[1] > 0.1


def _device_args(target, draft, prompts, shape, **kw):
  req, steps, capacity = plain.prepare(target.config, prompts, **kw)
  tg, ts = nnx.split(target)
  dg, ds = nnx.split(draft)
  return (tg, ts, dg, ds, req), dict(k=None, steps=steps, capacity=capacity + shape.cache_slack,
                                     pad_id=0, tree=shape)


@pytest.mark.slow
def test_one_executable_and_no_host_communication(fixture_model, random_draft):
  rng = np.random.default_rng(9)
  p1 = [rng.integers(0, 512, 40).tolist(), rng.integers(0, 512, 33).tolist()]
  p2 = [rng.integers(0, 512, 63).tolist(), rng.integers(0, 512, 50).tolist()]
  with count_compiles() as first:
    spec.generate(fixture_model, random_draft, p1, tree="3x2x4", max_new_tokens=5, stop_tokens=[])
  with count_compiles() as second:
    spec.generate(fixture_model, random_draft, p2, tree="3x2x4", max_new_tokens=7,
                  temperature=0.7, seed=3, stop_tokens=[11])
  assert len(first) == 1 and len(second) == 0
  shape = TreeShape(3, 2, 4)
  args, static = _device_args(fixture_model, random_draft, [[1, 2, 3]], shape, max_new_tokens=6)
  exe = spec.spec_generate_jit.lower(*args, **static).compile()
  hlo = exe.as_text()
  assert "while" in hlo.split("ENTRY")[1]
  for f in ("xla_ffi_python_cpu_callback", "xla_python_cpu_callback", " send(", " recv(",
            " infeed(", " outfeed("):
    assert f not in hlo, f
  _, ts, _, ds, req = args
  with jax.transfer_guard_device_to_host("disallow"):
    tokens, num, stats, _ = exe(ts, ds, req)
    tokens.block_until_ready()
  assert int(num[0]) == 6


def test_bad_tree_shapes(fixture_model):
  with pytest.raises(ValueError, match="smaller than tree depth"):
    TreeShape(depth=5, topk=4, nodes=3)
  with pytest.raises(ValueError, match="exceeds the 6 candidates"):
    TreeShape(depth=2, topk=2, nodes=7)
  with pytest.raises(ValueError, match="positive integer"):
    TreeShape(depth=0, topk=2, nodes=2)
  with pytest.raises(ValueError, match="DEPTHxTOPKxNODES"):
    TreeShape.parse("5x8")
  assert str(TreeShape.parse(" 5x8x32 ")) == "5x8x32"
  small_vocab = draft_lib.init_draft(
      draft_lib.Eagle3Config.for_target(fixture_model.config, draft_vocab_size=4), seed=0)
  with pytest.raises(ValueError, match="larger than the draft vocabulary"):
    spec.generate(fixture_model, small_vocab, [[1, 2]], tree="2x5x5")
  with pytest.raises(TypeError, match="TreeShape"):
    spec.generate(fixture_model, small_vocab, [[1, 2]], tree=(2, 2, 2))


def test_commit_path_moves_fp8_scales_with_their_entries():
  """A committed path's K/V entries AND their per-token FP8 scales land at slots start..start+d
  (a NumPy reference of the move); other slots keep their values."""
  rng = np.random.default_rng(7)
  B, S, K, Dh, layers = 2, 24, 2, 4, 2
  start = np.array([5, 11])
  path = np.array([[0, 2, 5, 6], [0, 1, 3, 7]])
  f8 = lambda: [jnp.asarray(rng.standard_normal((B, S, K, Dh)), jnp.float8_e4m3fn)
                for _ in range(layers)]
  sc = lambda: [jnp.asarray(rng.uniform(0.5, 2, (B, S, K)), jnp.float32) for _ in range(layers)]
  cache = kvc.KVCache(k=tuple(f8()), v=tuple(f8()), lengths=jnp.asarray(start + 8, jnp.int32),
                      k_scale=tuple(sc()), v_scale=tuple(sc()))
  out = tree_lib.commit_path(cache, jnp.asarray(start, jnp.int32), jnp.asarray(path, jnp.int32))
  for name in ("k", "v", "k_scale", "v_scale"):
    for before, after in zip(getattr(cache, name), getattr(out, name)):
      before = np.asarray(before.astype(jnp.float32))
      want = before.copy()
      for b in range(B):
        want[b, start[b]:start[b] + path.shape[1]] = before[b, start[b] + path[b]]
      np.testing.assert_array_equal(np.asarray(after.astype(jnp.float32)), want, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["3x2x4", "5x4x16"])
def test_fp8_kv_cache_tree_greedy_lossless(fixture_model, shape):
  """Tree drafting with an FP8 KV cache (the commit used to drop the scales from the loop carry):
  output equals plain greedy output of the same FP8-cache target."""
  from maverick import quant
  target = quant.quantize_model(fixture_model, quant.QuantConfig(weights=None, kv_cache="fp8"))
  draft = draft_lib.init_draft(draft_lib.Eagle3Config.for_target(target.config), seed=1)
  prompts, kw = _prompts(3, seed=3), dict(max_new_tokens=12, stop_tokens=[])
  assert spec.generate(target, draft, prompts, tree=shape, **kw).tokens == \
      plain.generate(target, prompts, **kw).tokens
