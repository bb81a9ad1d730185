"""Sampling options against float64 NumPy references: f32 logits, penalties / min_p / min_tokens /
logit_bias (plain, chain and tree, greedy), and per-request random streams (a seeded request
samples the same tokens alone or among other requests, in generate and in the serving engine).
The speculative chi-squared tests of these options are in tests/test_spec_lossless.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maverick
import spec_decode
from maverick import generation as gen
from maverick import model as model_lib
from maverick import sampling
from maverick.serving import Engine

import spec_oracles as so
from test_serving_engine import _run
from test_spec_decode import SMALL, bigram_target_and_oracle_draft

WAIT_S = 300


def test_logits_are_float32_from_the_projection():
  """A bf16 model's logits come out f32 with f32 precision: most are not bf16 values (a bf16
  output would tie near-equal logits), and they equal a float64 product of the final-normed hidden
  state and the output projection (to bf16 level: XLA may keep the norm's output in f32)."""
  cfg = SMALL.replace(dtype="bfloat16", vocab_size=64)
  model = model_lib.init_model(cfg, seed=2)
  tokens = jnp.asarray([[3, 9, 1, 7, 22, 5]])
  out = model_lib.apply(*nnx.split(model), tokens, capture_layers=(cfg.num_hidden_layers - 1,))
  assert out.logits.dtype == jnp.float32
  got = np.asarray(out.logits)
  as_bf16 = np.asarray(jnp.asarray(got).astype(jnp.bfloat16).astype(jnp.float32))
  assert (got != as_bf16).mean() > 0.9
  normed = np.asarray(model.final_norm(out.hidden[0]), np.float64)
  want = normed @ np.asarray(model.output_projection(), np.float64)
  np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max())


# ---------------------------------------------------------------------------------------------
# The transforms, one step, against NumPy
# ---------------------------------------------------------------------------------------------
ROW_OPTIONS = [  # per row: (options, prompt, generated so far, extra drafts before position 1)
    dict(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.4),
    dict(temperature=1.2, min_p=0.2, logit_bias={2: 3.0, 7: -5.0, 29: 1.5}),
    dict(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0),  # greedy, penalised
    dict(temperature=0.7, top_k=6, top_p=0.9, min_tokens=5, presence_penalty=-0.4),
    # min_tokens == tokens generated before position 1 (1 + 2 drafts): unmasked there.
    dict(temperature=1.0, min_tokens=3, repetition_penalty=0.7, logit_bias={4: -100.0}),
]
STOP = [4, 9]


def _stack_params(rows, V, width=4):
  params = [sampling.SamplingParams.create(1, seed=[i], vocab_size=V, bias_width=width, **o)
            for i, o in enumerate(rows)]
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *params)


def test_adjusted_distribution_matches_numpy():
  """p of every row (history: prompt, generated tokens, and at position 1 two more drafts) from
  adjust + probabilities equals the float64 NumPy reference of vLLM's definitions."""
  rng = np.random.default_rng(7)
  B, V, T = len(ROW_OPTIONS), 30, 2
  logits = rng.normal(size=(B, T, V)).astype(np.float32) * 2
  prompts = [rng.integers(0, V, 5) for _ in range(B)]
  generated = [rng.integers(0, V, n) for n in (3, 0, 4, 2, 1)]
  extra = rng.integers(0, V, (B, 2))
  params = _stack_params(ROW_OPTIONS, V)
  stop = jnp.asarray([STOP] * B, jnp.int32)
  out = sampling.init_output(B, 8, 1, 0, jnp.asarray(np.stack(prompts), jnp.int32),
                             jnp.full((B,), 5, jnp.int32), V)
  for j in range(max(map(len, generated))):  # commit the generated tokens one column at a time
    col = np.array([g[j] if j < len(g) else 0 for g in generated], np.int32)
    out = sampling.append(out, jnp.asarray(col[:, None]),
                          jnp.asarray([int(j < len(g)) for g in generated]),
                          jnp.full((B, 1), -1, jnp.int32), jnp.full((B,), 99, jnp.int32), 0)
  hist = np.stack([np.full(2, -1), np.full(2, -1)])[None].repeat(B, 0)  # [B, T, 2]
  hist[:, 1] = extra
  adjusted = sampling.adjust(jnp.asarray(logits), params, out, stop, jnp.asarray(hist))
  reps = lambda x: jnp.repeat(x, T, axis=0)
  got = np.asarray(sampling.probabilities(adjusted.reshape(B * T, V),
                                          jax.tree.map(reps, params))).reshape(B, T, V)
  for b, opts in enumerate(ROW_OPTIONS):
    for t in range(T):
      seen = np.concatenate([generated[b], extra[b] if t else []]).astype(int)
      want = so.adjusted_probs(logits[b, t][None], prompts[b], seen[None], stop=STOP, **opts)[0]
      # Support (a bias of -100 leaves e^-100: 0 in f32, not in f64).
      np.testing.assert_array_equal(got[b, t] > 0, want > 1e-30, err_msg=f"row {b} position {t}")
      np.testing.assert_allclose(got[b, t], want, atol=2e-6, err_msg=f"row {b} position {t}")
  # The history is counted: token counts equal the generated tokens'.
  counts = np.asarray(out.counts)
  for b in range(B):
    np.testing.assert_array_equal(counts[b], np.bincount(generated[b], minlength=V))


def test_bad_options_name_the_parameter():
  for kw, words in [(dict(presence_penalty=2.5), "presence_penalty must be a number in [-2, 2]"),
                    (dict(repetition_penalty=-1.0), "repetition_penalty must be in (0, 10]"),
                    (dict(min_p=-0.1), "min_p must be in [0, 1]"),
                    (dict(min_tokens=1.5), "min_tokens must be an integer >= 0"),
                    (dict(logit_bias={99: 1.0}), "outside the vocabulary [0, 30)"),
                    (dict(seed=[1, 2]), "one per row (3)")]:
    with pytest.raises(ValueError) as e:
      sampling.SamplingParams.create(3, vocab_size=30, **kw)
    assert words in str(e.value), (kw, str(e.value))


# ---------------------------------------------------------------------------------------------
# Whole loops: greedy with every history-reading option vs a host loop of full forwards
# ---------------------------------------------------------------------------------------------
GREEDY_OPTIONS = dict(presence_penalty=0.9, frequency_penalty=0.7, repetition_penalty=1.6,
                      min_tokens=4, logit_bias={1: 0.8, 6: -0.5})
PROMPTS = [[3, 11, 7], [5, 2], [14, 1, 8, 20]]
N_NEW = 9


@pytest.fixture(scope="module")
def pair():
  return bigram_target_and_oracle_draft(3, SMALL)


def _host_greedy(target, prompt, n, stop, **opts):
  """Argmax of the NumPy-adjusted logits of a full forward per token; stops after a stop id."""
  graphdef, state = nnx.split(target)
  seq = list(prompt)
  for _ in range(n):
    # Right-padded to one length (one compile): a causal forward's logits at len-1 ignore the pad.
    padded = jnp.asarray([seq + [0] * (32 - len(seq))])
    logits = np.asarray(model_lib.apply(graphdef, state, padded).logits[:, len(seq) - 1])
    p = so.adjusted_probs(logits, prompt, np.asarray([seq[len(prompt):]]), 0.0, stop=stop,
                          **opts)
    seq.append(int(p[0].argmax()))
    if seq[-1] in stop:
      break
  return seq[len(prompt):]


@pytest.mark.slow
def test_penalised_greedy_plain_chain_and_tree_equal_a_host_loop(pair):
  """The stop id is the row's unconstrained greedy token at a step before min_tokens, so masking
  shows; chain and tree verification must count the drafts accepted earlier in the round."""
  target, draft = pair
  free = so.greedy(target, PROMPTS, N_NEW)
  stop = sorted({free[0][1], free[1][2]})
  want = [_host_greedy(target, p, N_NEW, stop, **GREEDY_OPTIONS) for p in PROMPTS]
  assert want != [_host_greedy(target, p, N_NEW, stop) for p in PROMPTS]  # the options matter
  kw = dict(max_new_tokens=N_NEW, stop_tokens=stop, **GREEDY_OPTIONS)
  assert gen.generate(target, PROMPTS, **kw).tokens == want
  for shape in (dict(k=3), dict(tree="3x2x5")):
    got = spec_decode.generate(target, draft, PROMPTS, **shape, **kw)
    assert got.tokens == want, shape
    assert got.acceptance_length > 1.2, shape  # drafts were accepted, penalties and all


# ---------------------------------------------------------------------------------------------
# Per-request random streams
# ---------------------------------------------------------------------------------------------
SAMPLED = dict(temperature=1.0, top_p=0.95, presence_penalty=0.3)


@pytest.mark.slow
def test_seeded_rows_sample_the_same_alone_and_in_a_batch(pair):
  """Row i with seed s_i gives the same tokens as the request alone with seed s_i, plain and
  speculative; different seeds give different text."""
  target, draft = pair
  seeds = [11, 12, 13]
  kw = dict(max_new_tokens=N_NEW, stop_tokens=[], **SAMPLED)
  for shape in (None, dict(k=3), dict(tree="3x2x5")):
    run = (lambda p, s: gen.generate(target, p, seed=s, **kw)) if shape is None else \
        (lambda p, s: spec_decode.generate(target, draft, p, seed=s, **shape, **kw))
    batch = run(PROMPTS, seeds).tokens
    for p, s, toks in zip(PROMPTS, seeds, batch):
      assert run([p], [s]).tokens[0] == toks, (shape, s)
    assert run([PROMPTS[0]], [99]).tokens[0] != batch[0], shape


# ---------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------
def _np_log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.slow
def test_logprobs_match_a_float64_reference(pair):
  """Each generated token's logprob and its top-4 alternatives (plain, chain, tree) equal the log
  of the NumPy float64 distribution it was sampled from (penalties, bias, temperature, top-k on
  the target's logits at that position); prompt logprobs equal a float64 log-softmax."""
  target, draft = pair
  opts = dict(temperature=0.8, top_k=10, presence_penalty=0.4, repetition_penalty=1.3,
              logit_bias={2: 1.0})
  kw = dict(max_new_tokens=6, stop_tokens=[], seed=[5, 6, 7], logprobs=4, **opts)
  graphdef, state = nnx.split(target)
  for shape in (None, dict(k=3), dict(tree="3x2x5")):
    out = (gen.generate(target, PROMPTS, **kw) if shape is None else
           spec_decode.generate(target, draft, PROMPTS, **shape, **kw))
    for b, prompt in enumerate(PROMPTS):
      toks = out.tokens[b]
      logits = np.asarray(model_lib.apply(graphdef, state, jnp.asarray([prompt + toks])).logits[0])
      assert len(out.logprobs[b]) == len(toks) == 6
      for i, (got, top) in enumerate(out.logprobs[b]):
        probs = so.adjusted_probs(logits[len(prompt) - 1 + i][None], prompt, [toks[:i]], **opts)
        with np.errstate(divide="ignore"):
          want = np.log(probs[0])
        assert abs(got - want[toks[i]]) < 1e-4, (shape, b, i, got, want[toks[i]])
        ids, vals = zip(*top)
        np.testing.assert_array_equal(ids, np.argsort(-want, kind="stable")[:4])
        np.testing.assert_allclose(vals, want[list(ids)], atol=1e-4)
  prompt = PROMPTS[2] + [9, 9, 17]
  got = gen.prompt_logprobs(target, prompt, top=3)
  want = _np_log_softmax(
      np.asarray(model_lib.apply(graphdef, state, jnp.asarray([prompt])).logits[0]))
  assert got[0] is None and len(got) == len(prompt)
  for t in range(1, len(prompt)):
    lp, top = got[t]
    assert abs(lp - want[t - 1, prompt[t]]) < 1e-4
    assert [i for i, _ in top] == np.argsort(-want[t - 1])[:3].tolist()


def test_no_logprobs_asked_none_returned(pair):
  target, _ = pair
  out = gen.generate(target, PROMPTS[:1], max_new_tokens=2, stop_tokens=[])
  assert out.logprobs is None
  out = gen.generate(target, PROMPTS[:1], max_new_tokens=2, stop_tokens=[], logprobs=0)
  assert [top for _, top in out.logprobs[0]] == [[], []]
  assert all(lp <= 0 for lp, _ in out.logprobs[0])  # greedy: log p of the argmax at temperature 1


@pytest.fixture(scope="module")
def loaded():
  return maverick.load("tiny")


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["plain", "k3", "tree"])
def test_engine_seeded_request_alone_and_among_31_others(loaded, shape):
  """The same seeded, sampled, penalised request gives identical text (and logprobs) alone
  (batch-1 step) and mixed into 31 other concurrent requests (batch-32 step, other seeds and
  options); its first event carries the prompt's logprobs."""
  model, tok = loaded.model, loaded.tokenizer
  draft = None if shape == "plain" else spec_decode.load_draft("tiny", model)
  extra = dict(k=3) if shape == "k3" else dict(tree=spec_decode.TreeShape(3, 2, 5))
  engine = Engine(model, draft, slots=32, max_seq_len=32, rounds=2, min_bucket=16,
                  batch_buckets=[1], stop_tokens=loaded.stop_tokens,
                  **({} if draft is None else extra))
  prompt = tok.encode("def add(a, b):")
  mine = dict(seed=1234, temperature=0.9, frequency_penalty=0.4, logit_bias={5: 1.0}, logprobs=3,
              prompt_logprobs=True)
  rng = np.random.default_rng(0)
  others = [(rng.integers(1, 200, int(rng.integers(2, 10))).tolist(), int(rng.integers(4, 14)),
             dict(seed=int(rng.integers(0, 2**31)), temperature=float(rng.choice([0.0, 0.7, 1.3])),
                  presence_penalty=float(rng.choice([0.0, 0.5])))) for _ in range(31)]
  others.insert(13, (prompt, 12, mine))
  engine.start()
  try:
    events_alone, events_mixed = [[]], [[] for _ in others]
    alone = _run(engine, [prompt], [12], [mine], events_alone)[0]
    mixed = _run(engine, *map(list, zip(*others)), events_mixed)[13]
  finally:
    engine.shutdown()
  assert engine.steps_by_batch[1] > 0 and engine.steps_by_batch[32] > 0, engine.steps_by_batch
  assert len(alone) > 3 and mixed == alone
  lp = lambda events: [x for e in events for x in e.logprobs]
  a, m = lp(events_alone[0]), lp(events_mixed[13])
  assert len(a) == len(alone) and [len(top) for _, top in a] == [3] * len(a)
  # Values agree to the model's precision only: the bf16 tiny model's batch-32 and batch-1 step
  # programs give logits that differ by ~1e-2 (other matmul tilings), not the sampled tokens.
  np.testing.assert_allclose([x for x, _ in m], [x for x, _ in a], atol=5e-2)
  first = events_alone[0][0].prompt_logprobs
  assert first[0] is None and len(first) == len(prompt)
  assert all(e.prompt_logprobs is None for e in events_alone[0][1:])
