"""Prefill flash attention (pallas_kernels.prefill_attention): the sm90 and sm100 kernels in GPU
interpret mode (race detection on) and the XLA reference against a float64 NumPy reference;
lowering for CUDA (sm90, sm100) at Maverick shapes; bad input; the toy benchmark cases."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelInputError, common
from pallas_kernels.prefill_attention import bench, sm90, sm100
from pallas_kernels.prefill_attention import prefill_attention

# bf16 inputs, bf16 output. Per element, with p the softmax weights: the probabilities enter P V
# rounded to bf16 (relative error <= 2^-8 each, so <= 2^-8 * sum_i p_i |v_i| on the output) and
# the output is rounded to bf16 once (<= 2^-8 |out|); f32 softmax and accumulation add ~1e-6
# relative (the 1 % slack). A worst case, whatever order the sums run in on whichever CPU (a flat
# atol of 2e-2 was within 1.5x of the 1.3e-2 measured and below this bound's worst case).
BF16_EPS = 2.0 ** -8


def attention_f64(q, k, v, lengths, chunk_size, sm_scale=None):
  """Float64 NumPy attention over the mask described in api.py; padding rows are 0."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, H, Dh = q.shape
  G = H // k.shape[2]
  scale = Dh ** -0.5 if sm_scale is None else sm_scale
  out = np.zeros_like(q)
  pos = np.arange(T)
  for b in range(B):
    n = int(lengths[b])
    visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] < n) & (pos[:, None] < n)
    if chunk_size is not None:
      visible &= pos[None, :] // chunk_size == pos[:, None] // chunk_size
    for h in range(H):
      s = q[b, :, h] @ k[b, :, h // G].T * scale
      s = np.where(visible, s, -np.inf)
      m = s.max(axis=1, keepdims=True)
      p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
      denom = p.sum(axis=1, keepdims=True)
      out[b, :, h] = (p / np.where(denom > 0, denom, 1.0)) @ v[b, :, h // G]
  return out


def make_inputs(B, T, H, K, Dh, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(B, T, K, Dh)), jnp.bfloat16)
  v = jnp.asarray(rng.normal(size=(B, T, K, Dh)), jnp.bfloat16)
  return q, k, v


def assert_matches(out, q, k, v, lengths, chunk_size):
  want = attention_f64(q, k, v, lengths, chunk_size)
  got = np.asarray(out, np.float64)
  assert got.shape == want.shape and out.dtype == jnp.bfloat16
  weighted_abs_v = attention_f64(q, k, np.abs(np.asarray(v, np.float64)), lengths, chunk_size)
  bound = BF16_EPS * (weighted_abs_v + np.abs(want)) * 1.01
  worst = np.max(np.abs(got - want) / np.maximum(bound, np.finfo(np.float64).tiny))
  assert worst <= 1, f"error up to {worst:.3g}x the bf16 rounding bound"
  for b, n in enumerate(lengths):  # padding rows are exactly 0
    assert not np.any(got[b, int(n):])


# (B, T, H, K, Dh, chunk_size, lengths, config): odd T, GQA ratios 1/4/5, chunk boundaries inside a
# KV block (48 with block 64) and on one (64), lengths 0 and 1, several pipeline steps per CTA, one
# and two compute warpgroups, 1 to 3 pipeline stages.
C = sm90.Config
KERNEL_CASES = [
    pytest.param(1, 80, 2, 2, 64, None, [80], C(block_kv=64), id="global-G1-T80"),
    pytest.param(2, 80, 8, 2, 64, 48, [80, 37], C(block_kv=64), id="chunk48-G4-T80-len37"),
    pytest.param(2, 100, 5, 1, 64, 64, [0, 1], C(block_kv=64), id="chunk64-G5-T100-len0-len1"),
    pytest.param(1, 160, 5, 1, 64, None, [131], C(block_kv=64, num_stages=3, num_compute_wgs=1),
                 id="global-G5-T160-1wg-3stages"),
    pytest.param(1, 96, 4, 1, 128, 40, [96], C(block_kv=128, num_stages=1),
                 id="dh128-chunk40-G4-T96"),
]


@pytest.mark.slow
@pytest.mark.parametrize("B,T,H,K,Dh,chunk_size,lengths,config", KERNEL_CASES)
def test_sm90_kernel_interpret(B, T, H, K, Dh, chunk_size, lengths, config):
  q, k, v = make_inputs(B, T, H, K, Dh)
  lengths = np.asarray(lengths, np.int32)
  with common.interpret():
    out = sm90.prefill_attention(q, k, v, jnp.asarray(lengths), chunk_size=chunk_size,
                                 sm_scale=Dh ** -0.5, config=config)
    out = jax.block_until_ready(out)
  assert_matches(out, q, k, v, lengths, chunk_size)


# sm100 (tcgen05, TMEM, TMA producer warpgroup + 1 or 2 compute warpgroups of 128 rows each): chunk
# boundary inside a block, lengths 0 and 1, GQA 5 with odd T, more KV blocks than ring slots (the
# ring wraps, with 1 and 2 consumers per slot), 2 compute warpgroups taking turns.
C100 = sm100.Config

@pytest.mark.slow
@pytest.mark.parametrize("B,T,H,K,Dh,chunk_size,lengths,config", [
    pytest.param(2, 80, 4, 1, 64, 48, [80, 0], C100(num_stages=2, num_compute_wgs=1),
                 id="chunk48-G4-len0"),
    pytest.param(1, 160, 5, 1, 128, None, [150], C100(num_stages=1, num_compute_wgs=1),
                 id="dh128-global-G5-unmasked-block"),
    pytest.param(1, 256, 1, 1, 64, None, [251], C100(num_stages=2, num_compute_wgs=1),
                 id="global-G1-T256-ring-wraps"),
    pytest.param(2, 37, 5, 1, 64, 32, [0, 1], C100(num_stages=2, num_compute_wgs=1),
                 id="chunk32-G5-T37-len0-len1"),
    pytest.param(1, 200, 2, 1, 64, 96, [197], C100(num_stages=2, num_compute_wgs=2),
                 id="chunk96-G2-2wg-ping-pong-ring-wraps"),
])
def test_sm100_kernel_interpret(B, T, H, K, Dh, chunk_size, lengths, config):
  q, k, v = make_inputs(B, T, H, K, Dh, seed=4)
  lengths = np.asarray(lengths, np.int32)
  with common.interpret(arch="sm100"):
    out = sm100.prefill_attention(q, k, v, jnp.asarray(lengths), chunk_size=chunk_size,
                                  sm_scale=Dh ** -0.5, config=config)
    out = jax.block_until_ready(out)
  assert_matches(out, q, k, v, lengths, chunk_size)


def test_api_pallas_interpret_default_lengths():
  q, k, v = make_inputs(1, 50, 4, 1, 64, seed=1)
  with common.interpret():
    out = jax.block_until_ready(prefill_attention(q, k, v, chunk_size=32, implementation="pallas"))
  assert_matches(out, q, k, v, [50], 32)


@pytest.mark.parametrize("chunk_size,lengths", [(None, [33, 0]), (24, [64, 1])])
def test_xla_reference(chunk_size, lengths):
  q, k, v = make_inputs(2, 64, 10, 2, 64, seed=2)
  lengths = np.asarray(lengths, np.int32)
  out = prefill_attention(q, k, v, lengths=jnp.asarray(lengths), chunk_size=chunk_size,
                          implementation="xla")
  assert_matches(out, q, k, v, lengths, chunk_size)


def test_auto_falls_back_to_xla_for_unsupported_head_dim():
  q, k, v = make_inputs(1, 16, 2, 1, 96, seed=3)
  with common.interpret():
    out = prefill_attention(q, k, v)  # auto: head_dim 96 has no kernel -> reference
  assert_matches(out, q, k, v, [16], None)
  with common.interpret(), pytest.raises(KernelInputError, match="head_dim=96"):
    prefill_attention(q, k, v, implementation="pallas")


# Maverick prefill (T=8192, chunk 8192 = RoPE layers, None = NoPE layers), a shorter prompt (64-key
# blocks below 256 tokens) and head_dim 64. Outside interpret() this is the GPU code path (P V
# accumulated in place), which the interpreter cannot run: lowering is its only check on CPU.
@pytest.mark.parametrize("B,T,H,K,Dh,chunk_size", [
    (1, 8192, 40, 8, 128, 8192), (1, 8192, 40, 8, 128, None), (2, 200, 40, 8, 128, 64),
    (1, 2048, 16, 4, 64, 1000)])
def test_lowers_for_sm90(B, T, H, K, Dh, chunk_size):
  _check_lowers(B, T, H, K, Dh, chunk_size, "sm90")


@pytest.mark.parametrize("B,T,H,K,Dh,chunk_size", [
    (1, 8192, 40, 8, 128, 8192), (1, 8192, 40, 8, 128, None), (1, 2048, 16, 4, 64, 1000)])
def test_lowers_for_sm100(B, T, H, K, Dh, chunk_size):
  _check_lowers(B, T, H, K, Dh, chunk_size, "sm100")


def _check_lowers(B, T, H, K, Dh, chunk_size, arch):
  S = jax.ShapeDtypeStruct
  fn = functools.partial(prefill_attention, chunk_size=chunk_size, implementation="pallas")
  text = common.lower_for_gpu(
      lambda q, k, v, n: fn(q, k, v, lengths=n),
      S((B, T, H, Dh), jnp.bfloat16), S((B, T, K, Dh), jnp.bfloat16),
      S((B, T, K, Dh), jnp.bfloat16), S((B,), jnp.int32), arch=arch)
  assert "mosaic_gpu" in text


def _bad(**overrides):
  q, k, v = (jax.ShapeDtypeStruct(s, jnp.bfloat16)
             for s in [(1, 8, 4, 64), (1, 8, 2, 64), (1, 8, 2, 64)])
  args = dict(q=q, k=k, v=v, lengths=None)
  args.update(overrides)
  return args


@pytest.mark.parametrize("overrides,match", [
    (dict(k=jax.ShapeDtypeStruct((1, 8, 2, 64), jnp.float32)), "share one float dtype"),
    (dict(k=jax.ShapeDtypeStruct((1, 8, 3, 64), jnp.bfloat16),
          v=jax.ShapeDtypeStruct((1, 8, 3, 64), jnp.bfloat16)), "multiple of kv heads"),
    (dict(lengths=jax.ShapeDtypeStruct((2,), jnp.int32)), "lengths must be"),
    (dict(lengths=jax.ShapeDtypeStruct((1, 1), jnp.int32)), "lengths must be"),
    (dict(v=jax.ShapeDtypeStruct((1, 8, 2, 32), jnp.bfloat16)), "v must have"),
], ids=["dtype-mismatch", "H-not-multiple-of-K", "lengths-wrong-B", "lengths-2d", "v-shape"])
def test_bad_input(overrides, match):
  args = _bad(**overrides)
  with pytest.raises(KernelInputError, match=match):
    jax.eval_shape(lambda q, k, v, lengths: prefill_attention(q, k, v, lengths=lengths),
                   args["q"], args["k"], args["v"], args["lengths"])


def test_unsupported_head_dim_with_pallas_raises():
  q, k, v = (jax.ShapeDtypeStruct(s, jnp.bfloat16)
             for s in [(1, 8, 2, 80), (1, 8, 1, 80), (1, 8, 1, 80)])
  with common.interpret(), pytest.raises(KernelInputError, match="head_dim=80"):
    jax.eval_shape(functools.partial(prefill_attention, implementation="pallas"), q, k, v)


def test_toy_benchmark_cases_match_reference():
  with common.interpret():
    for case in bench.benchmark_cases(toy=True):
      # Jitted as the runner does (inside interpret(): jit caches do not key on the context).
      got = np.asarray(jax.block_until_ready(jax.jit(case.kernel)(*case.args)), np.float32)
      want = np.asarray(jax.jit(case.reference)(*case.args), np.float32)
      err = np.abs(got - want).max() / np.abs(want).max()
      assert err <= case.max_rel_error, (case.name, err)
