"""Sampling and stopping against plain NumPy / Python references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maverick import sampling


def _np_filtered_probs(logits, temperature, top_k, top_p):
  """HF order and rules: temperature, top-k (ties at the k-th value kept), top-p over the ascending
  sort removing tokens whose cumulative mass <= 1 - top_p (the top token always kept)."""
  x = np.asarray(logits, np.float64) / temperature
  if top_k:
    kth = np.sort(x)[-top_k]
    x = np.where(x < kth, -np.inf, x)
  if top_p < 1:
    order = np.argsort(x)
    p = np.exp(x[order] - x.max())
    p /= p.sum()
    remove = np.cumsum(p) <= 1 - top_p
    remove[-1] = False
    x[order[remove]] = -np.inf
  p = np.exp(x - x.max())
  return p / p.sum()


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (5, 0.5), (1, 1.0),
                                         (0, 0.05)])
def test_filter_matches_hf_rules(top_k, top_p):
  rng = np.random.default_rng(3)
  logits = rng.normal(size=(4, 50)).astype(np.float32) * 2
  params = sampling.SamplingParams.create(4, temperature=0.7, top_k=top_k, top_p=top_p)
  got = np.asarray(jax.nn.softmax(sampling.processed_logits(jnp.asarray(logits), params)))
  for b in range(4):
    want = _np_filtered_probs(logits[b], 0.7, top_k, top_p)
    np.testing.assert_array_equal(got[b] > 0, want > 0)
    np.testing.assert_allclose(got[b], want, atol=1e-6)


def test_greedy_rows_ignore_the_key():
  rng = np.random.default_rng(4)
  logits = jnp.asarray(rng.normal(size=(3, 40)).astype(np.float32))
  params = sampling.SamplingParams.create(3, temperature=0.0, top_k=5, top_p=0.5)
  for seed in range(3):
    params.seed = jnp.full((3,), seed, jnp.uint32)
    toks, _ = sampling.sample(logits, params, sampling.empty_output(3, 40), jnp.full((3, 1), -1))
    np.testing.assert_array_equal(np.asarray(toks), np.argmax(np.asarray(logits), -1))


def test_sample_frequencies_match_distribution():
  """Chi-squared goodness of fit of 20k draws against the NumPy filtered distribution."""
  rng = np.random.default_rng(5)
  logits = rng.normal(size=(12,)).astype(np.float32)
  temperature, top_k, top_p = 1.3, 8, 0.9
  want = _np_filtered_probs(logits, temperature, top_k, top_p)
  n = 20000
  params = sampling.SamplingParams.create(n, temperature, top_k, top_p)
  draws = np.asarray(sampling.sample(jnp.broadcast_to(jnp.asarray(logits), (n, 12)),
                                     params, sampling.empty_output(n, 12), jnp.full((n, 1), -1))[0])
  counts = np.bincount(draws, minlength=12)
  assert counts[want == 0].sum() == 0
  support = want > 0
  expected = want[support] * n
  chi2 = ((counts[support] - expected) ** 2 / expected).sum()
  # 99.9% quantile of chi2 with (support - 1) <= 7 degrees of freedom is 24.3.
  assert chi2 < 24.3, (chi2, counts, expected)


def test_sampling_params_validation():
  with pytest.raises(ValueError, match="temperature"):
    sampling.SamplingParams.create(1, temperature=-0.1)
  with pytest.raises(ValueError, match="temperature"):
    sampling.SamplingParams.create(1, temperature=float("nan"))
  for p in (0.0, -0.5, 1.01):
    with pytest.raises(ValueError, match="top_p"):
      sampling.SamplingParams.create(1, top_p=p)
  with pytest.raises(ValueError, match="top_k"):
    sampling.SamplingParams.create(1, top_k=-1)


def _py_append(tokens, n, done, new, num_new, stops, max_tokens):
  """Plain-Python reference of `sampling.append` for one row."""
  if done:
    return tokens, n, done
  for t in new[:num_new]:
    if n >= max_tokens:
      break
    tokens = tokens + [t]
    n += 1
    if t in stops:
      return tokens, n, True
  return tokens, n, n >= max_tokens


def test_append_matches_python_reference():
  rng = np.random.default_rng(6)
  B, M, cap, pad = 5, 4, 12, -7
  stops = np.array([[3, -1], [3, 5], [-1, -1], [9, 3], [5, -1]], np.int32)
  max_tokens = np.array([12, 6, 3, 12, 9], np.int32)
  out = sampling.init_output(B, cap, M, pad, jnp.zeros((B, 1), jnp.int32),
                             jnp.zeros((B,), jnp.int32), 10)
  ref = [([], 0, False) for _ in range(B)]
  for _ in range(6):
    new = rng.integers(0, 10, size=(B, M)).astype(np.int32)
    num_new = rng.integers(1, M + 1, size=B).astype(np.int32)
    out = sampling.append(out, jnp.asarray(new), jnp.asarray(num_new), jnp.asarray(stops),
                          jnp.asarray(max_tokens), pad)
    ref = [_py_append(*ref[b], new[b].tolist(), num_new[b], stops[b].tolist(), max_tokens[b])
           for b in range(B)]
  for b in range(B):
    toks, n, done = ref[b]
    assert int(out.num_tokens[b]) == n and bool(out.done[b]) == done
    row = np.asarray(out.tokens[b])
    assert row[:n].tolist() == toks
    assert (row[n:] == pad).all()


def test_top_p_filter_lowers_for_gpu_without_a_sequential_scan():
  """jax >= 0.12 lowers jnp.cumsum for CUDA to `chlo.scan`, which XLA:GPU runs as a sequential
  `while` over the vocabulary (25,256 trips on a TP8 shard) that cannot sit in a command buffer:
  the speculative generate loop around it became host-driven. The filter's prefix sum must lower
  without one (a log-depth associative scan)."""
  import pallas_kernels
  sd = jax.ShapeDtypeStruct
  text = pallas_kernels.lower_for_gpu(sampling._filter_top_k_top_p, sd((2, 1000), jnp.float32),
                                      sd((2,), jnp.int32), sd((2,), jnp.float32))
  assert "scan" not in text and "while" not in text
