"""The model against the HF oracle, and the KV cache against full recompute."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.extend import core as jax_core

from maverick import config as config_lib
from maverick import kv_cache as kvc
from maverick import model as model_lib


def _apply(model, *args, **kw):
  return model_lib.apply(*nnx.split(model), *args, **kw)


def test_rope_inv_freq_matches_hf(fixture_model, hf_fixture):
  np.testing.assert_allclose(model_lib.rope_inv_freq(fixture_model.config),
                             hf_fixture["rope_inv_freq"], rtol=1e-6)


def test_forward_matches_hf_logits_and_hidden_states(fixture_model, hf_fixture):
  L = fixture_model.config.num_hidden_layers
  out = _apply(fixture_model, jnp.asarray(hf_fixture["inputs"]), capture_layers=tuple(range(L)))
  np.testing.assert_allclose(np.asarray(out.logits), hf_fixture["logits"], atol=1e-4, rtol=0)
  # hidden_states[0] is the embedding output, [i + 1] the output of layer i.
  np.testing.assert_allclose(np.asarray(out.hidden), hf_fixture["hidden_states"][1:], atol=1e-5,
                             rtol=0)
  assert np.array_equal(np.asarray(out.logits).argmax(-1), hf_fixture["logits"].argmax(-1))


def test_router_logits_match_hf(fixture_model, hf_fixture):
  """Router input = post-attention norm of (layer input + attention); recomputed from the HF
  hidden states of the layer before, so a routing bug is localised to the MoE layer."""
  cfg = fixture_model.config
  hs = jnp.asarray(hf_fixture["hidden_states"])
  B, T = hf_fixture["inputs"].shape
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  for n, i in enumerate(cfg.moe_layers):
    layer = fixture_model.layers[i]
    x = hs[i]
    x = x + layer.attn(layer.input_norm(x), pos)[0]
    h = layer.post_attn_norm(x).reshape(B * T, -1)
    logits = h @ layer.ffn.router[...]
    np.testing.assert_allclose(np.asarray(logits), hf_fixture["router_logits"][n], atol=1e-5)


def _recompute_logits(model, rows):
  """Full-sequence forward without a cache. Rows are right-padded into one batch: attention is
  causal, so padding after a row's end cannot reach its logits."""
  batch = np.zeros((len(rows), max(map(len, rows))), np.int32)
  for b, r in enumerate(rows):
    batch[b, :len(r)] = r
  logits = np.asarray(_apply(model, jnp.asarray(batch)).logits)
  return [logits[b, :len(r)] for b, r in enumerate(rows)]


def _cached_logits(model, rows, prompt_lens, step_sizes, capacity):
  """Prefill right-padded prompts, then decode the rest of each row in steps of `step_sizes`
  tokens (teacher forced). Returns per-row logits for every position after the prompt start."""
  B = len(rows)
  graphdef, state = nnx.split(model)
  Tp = max(prompt_lens)
  prompt = np.zeros((B, Tp), np.int32)
  for b, r in enumerate(rows):
    prompt[b, :prompt_lens[b]] = r[:prompt_lens[b]]
  cache = kvc.KVCache.init(model.config, B, capacity)
  out = model_lib.apply(graphdef, state, jnp.asarray(prompt), cache=cache, prefill=True)
  cache = out.cache.with_lengths(jnp.asarray(prompt_lens))
  got = [list(np.asarray(out.logits[b, :prompt_lens[b]])) for b in range(B)]
  pos = list(prompt_lens)
  for T in step_sizes:
    toks = np.zeros((B, T), np.int32)
    for b, r in enumerate(rows):
      seg = r[pos[b]:pos[b] + T]
      toks[b, :len(seg)] = seg
    out = model_lib.apply(graphdef, state, jnp.asarray(toks), cache=cache)
    cache = out.cache
    for b in range(B):
      n = max(0, min(T, len(rows[b]) - pos[b]))
      got[b].extend(np.asarray(out.logits[b, :n]))
      pos[b] += T
  return [np.stack(g) for g in got]


def _random_rows(rng, vocab, lengths):
  return [rng.integers(0, vocab, size=n).tolist() for n in lengths]


@pytest.mark.slow
def test_cache_decode_equals_recompute_fixture(fixture_model, hf_fixture):
  """Prefill + decode (1 and 4 tokens per step) == full recompute at every step, batch of 3 rows
  of different lengths whose prompts straddle chunk boundaries (chunk 16)."""
  rng = np.random.default_rng(0)
  rows = [hf_fixture["inputs"][0].tolist()[:45]] + _random_rows(rng, 512, [40, 44])
  prompt_lens = [17, 31, 15]  # 17 and 31 straddle 16; decoding crosses 32
  steps = [1, 1, 4, 1, 4, 4, 1, 4, 4, 4, 4]
  cached = _cached_logits(fixture_model, rows, prompt_lens, steps, capacity=64)
  ref = _recompute_logits(fixture_model, rows)
  for c, r in zip(cached, ref):
    _assert_close_f32(c, r[:len(c)])  # a flat atol of 1e-5 sat within 2x of the 5.7e-6 measured
    assert len(c) == len(r)


# Configs the fixture does not cover, each with features switched differently.
EXTRA_CONFIGS = {
    "top2_tied_moe_every_layer_nope3": config_lib.tiny_top2_tied(),
    "temp_tuning_no_qknorm_nope2_dense_rope": config_lib.Config(
        vocab_size=300, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
        num_local_experts=4, num_experts_per_tok=1, moe_layers=(0, 3), use_qk_norm=False,
        attention_chunk_size=8, no_rope_layer_interval=2, attn_temperature_tuning=True,
        floor_scale=4.0, attn_scale=0.3, rope_theta=10000.0, dtype="float32"),
}


def _assert_close_f32(actual, ref):
  # f32 noise scales with the logits (random init reaches ~10): 1e-5 of the logit scale.
  np.testing.assert_allclose(actual, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)


@pytest.fixture(scope="module", params=sorted(EXTRA_CONFIGS))
def extra_model(request):
  return model_lib.init_model(EXTRA_CONFIGS[request.param], seed=7)


@pytest.mark.slow
def test_extra_config_cache_equals_recompute(extra_model):
  rng = np.random.default_rng(1)
  V = extra_model.config.vocab_size
  rows = _random_rows(rng, V, [30, 26, 21])
  cached = _cached_logits(extra_model, rows, [9, 13, 4], [1, 4, 1, 4, 1, 4, 4, 4, 1, 4],
                          capacity=40)
  for c, r in zip(cached, _recompute_logits(extra_model, rows)):
    _assert_close_f32(c, r)


@pytest.mark.slow
def test_extra_config_padding_rows_do_not_change_other_rows(extra_model):
  """A row's logits are the same alone and in a right-padded batch with other rows."""
  rng = np.random.default_rng(2)
  V = extra_model.config.vocab_size
  rows = _random_rows(rng, V, [19, 7, 12])
  T = 24
  batch = np.full((3, T), V - 1, np.int32)  # padding with a real token id on purpose
  for b, r in enumerate(rows):
    batch[b, :len(r)] = r
  together = np.asarray(_apply(extra_model, jnp.asarray(batch)).logits)
  for b, r in enumerate(rows):
    alone = np.asarray(_apply(extra_model, jnp.asarray([r])).logits[0])
    _assert_close_f32(together[b, :len(r)], alone)


def test_capture_layers_are_residual_stream(fixture_model, hf_fixture):
  """Capturing a subset returns those layers' outputs and leaves the logits unchanged."""
  x = jnp.asarray(hf_fixture["inputs"])
  out = _apply(fixture_model, x, capture_layers=(1, 3, 4))
  np.testing.assert_allclose(np.asarray(out.hidden), hf_fixture["hidden_states"][[2, 4, 5]],
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(out.logits), hf_fixture["logits"], atol=1e-4)
  with pytest.raises(ValueError, match="capture_layers"):
    fixture_model(x, capture_layers=(8,))


def test_logits_at_selects_positions(fixture_model, hf_fixture):
  x = jnp.asarray(hf_fixture["inputs"])
  idx = jnp.asarray([52, 20])
  out = _apply(fixture_model, x, logits_at=idx)
  np.testing.assert_allclose(np.asarray(out.logits),
                             hf_fixture["logits"][[0, 1], [52, 20]], atol=1e-4)


def test_bf16_forward_close_to_f32(hf_fixture_dir, hf_fixture):
  from maverick.checkpoint import load_hf
  m = load_hf(str(hf_fixture_dir), dtype="bfloat16")
  logits = np.asarray(_apply(m, jnp.asarray(hf_fixture["inputs"])).logits, np.float32)
  ref = hf_fixture["logits"]
  # bf16 rounds activations at 2^-8 relative a few times per layer; through 8 layers that is
  # ~1e-2 per position (measured median 0.011, p90 0.013): both under 2^-5. A position near a
  # top-1 routing tie may take another expert (an error of 0.1-0.3, on whichever CPU rounds it
  # over): at most 5 % of positions past 2^-3. (The worst element was 0.447 against a flat
  # 0.05 x the logit scale, 0.522: a routing flip on another CPU would have failed it.)
  err = np.linalg.norm(logits - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
  assert np.quantile(err, 0.5) < 2 ** -5 and np.quantile(err, 0.9) < 2 ** -5, err
  assert np.mean(err > 2 ** -3) <= 0.05, err
  assert (logits.argmax(-1) == ref.argmax(-1)).mean() > 0.9


def _dot_operands(jaxpr, watched: dict) -> list:
  """(name, operand index) of each dot_general reading a watched variable, followed through
  nested jits and dtype converts."""
  found = []
  for eqn in jaxpr.eqns:
    names = [None if isinstance(v, jax_core.Literal) else watched.get(v) for v in eqn.invars]
    if eqn.primitive.name == "dot_general":
      found += [(n, i) for i, n in enumerate(names) if n]
    elif eqn.primitive.name == "convert_element_type" and names[0]:
      watched[eqn.outvars[0]] = names[0]
    inner = eqn.params.get("jaxpr")
    if inner is not None:
      inner = getattr(inner, "jaxpr", inner)
      found += _dot_operands(inner, {v: n for v, n in zip(inner.invars, names) if n})
  return found


@pytest.mark.parametrize("fp8", [False, True])
def test_attention_matches_float64_and_reads_cache_as_stored(fp8):
  """GQA attention against a float64 NumPy reference, and the operand order XLA:GPU needs to read a
  [B, S, K, Dh] cache as stored: K the lhs of its dot, V the rhs (V as the lhs made every
  standalone decode step transpose each V cache whole, see scripts/gpu_compile_check.py)."""
  B, T, S, H, K, Dh = 2, 3, 16, 6, 2, 8
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal(s).astype(np.float32)
             for s in ((B, T, H, Dh), (B, S, K, Dh), (B, S, K, Dh)))
  pos = np.array([[5, 6, 7], [11, 12, 13]])
  mask = model_lib.attention_mask(jnp.asarray(pos), jnp.broadcast_to(jnp.arange(S), (B, S)), None)
  scales = {}
  if fp8:  # per-token scales, as the dynamic FP8 cache stores them
    ks, vs = (rng.uniform(0.5, 2.0, (B, S, K)).astype(np.float32) for _ in range(2))
    k8, v8 = (jnp.asarray(x).astype(jnp.float8_e4m3fn) for x in (k, v))
    k, v = (np.asarray(x.astype(jnp.float32)) * s[..., None] for x, s in ((k8, ks), (v8, vs)))
    args, scales = (k8, v8), dict(k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs))
  else:
    args = (jnp.asarray(k), jnp.asarray(v))
  got = model_lib.attention(jnp.asarray(q), *args, mask, **scales)
  # Reference: kv head of query head h is h // (H // K), as HF's repeat_interleave.
  kk, vv = (np.repeat(x.astype(np.float64), H // K, axis=2) for x in (k, v))
  s = np.einsum("bthd,bshd->bhts", q.astype(np.float64), kk) / np.sqrt(Dh)
  s = np.where(np.asarray(mask)[:, None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  want = np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), vv)
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
  closed = jax.make_jaxpr(lambda q_, k_, v_: model_lib.attention(q_, k_, v_, mask, **scales))(
      jnp.asarray(q), *args)
  watched = dict(zip(closed.jaxpr.invars[1:], ("k", "v")))
  assert sorted(_dot_operands(closed.jaxpr, watched)) == [("k", 0), ("v", 1)]
