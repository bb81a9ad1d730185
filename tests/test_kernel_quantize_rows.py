"""pallas_kernels.quantize_rows: the per-row FP8 quantize kernel in GPU interpret mode against a
float64 NumPy quantizer written here, its XLA reference against maverick.quant's (the model's
XLA path: bit-equal), lowering for sm_90 / sm_100 at the Maverick TP8 shard widths, and bad
input.

Tolerance: the kernel and NumPy see the same input; scales agree to f32 rounding (measured
2e-7 relative, bound 1e-5); an e4m3 value may differ by one code where x / s lands within f32 rounding of a
rounding boundary, so codes are compared by agreement (>= 99 %) and the dequantized rows within
one e4m3 step (2**-3 relative to the value, 2**-9 * 448 s near zero)."""

import jax
import ml_dtypes
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from maverick.quant import ops as quant_ops
from pallas_kernels import KernelInputError, quantize_rows as qr
from pallas_kernels.quantize_rows import reference

FP8 = jnp.float8_e4m3fn


def _np_quantize(x, rows_out, ub):
  """float64: s = clip(max|x|, 1/512, ub) / 448 per row; x / s, clipped to +-448."""
  x = np.asarray(x, np.float64)
  x = np.concatenate([x, np.zeros((rows_out - x.shape[0], x.shape[1]))])
  amax = np.maximum(np.abs(x).max(axis=1), 1 / 512)
  if ub is not None:
    amax = np.minimum(amax, ub)
  s = amax / 448
  return np.clip(x / s[:, None], -448, 448), s


def _check(q, s, x, rows_out, ub):
  want_scaled, want_s = _np_quantize(x, rows_out, ub)
  assert q.shape == (rows_out, x.shape[1]) and q.dtype == FP8 and s.shape == (rows_out,)
  np.testing.assert_allclose(np.asarray(s), want_s, rtol=1e-5)
  codes = np.asarray(jnp.asarray(want_scaled, jnp.float32).astype(FP8).astype(jnp.float32))
  got = np.asarray(q.astype(jnp.float32))
  assert np.mean(got == codes) >= 0.99, np.mean(got == codes)
  step = np.maximum(np.abs(want_scaled) * 2.0 ** -3, 2.0 ** -9)
  assert np.all(np.abs(got - want_scaled) <= step)


@pytest.mark.parametrize("m,k,rows_out,ub", [(3, 640, 8, None), (2, 1024, 64, 1200.0),
                                             (5, 256, 5, 2.0)],
                         ids=["vec1_padded", "vec8_tile", "ub_caps"])
def test_kernel_matches_float64_in_interpret_mode(m, k, rows_out, ub):
  """640 = 5 heads x 128 (the TP8 O-proj input: one element a thread), 1024 (vectors of 8),
  a cap below the rows' max (values clip at 448); pad rows come out zero with the floor scale."""
  rng = np.random.default_rng(k)
  x = rng.standard_normal((m, k)) * rng.uniform(0.5, 8.0, (m, 1))
  x[0, 7] = 40.0  # an outlier row
  x = jnp.asarray(x, jnp.bfloat16)
  with pallas_kernels.interpret():
    q, s = qr.quantize_rows(x, rows_out, ub, implementation="pallas")
  _check(q, s, x, rows_out, ub)
  if rows_out > m:
    assert np.all(np.asarray(q[m:].astype(jnp.float32)) == 0)


@pytest.mark.parametrize("ub", [None, 1200.0, 0.5])
def test_reference_equals_the_models_quantization(ub):
  """The op's XLA reference is maverick.quant's per-token quantization of the zero-padded rows,
  bit for bit (the kernel path and the model's XLA path quantize alike)."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((3, 512)) * 3, jnp.bfloat16)
  q, s = qr.quantize_rows(x, 8, ub, implementation="xla")
  q_ref, s_ref = quant_ops.quantize_rows(jnp.pad(x, ((0, 5), (0, 0))), (-1,), ub)
  np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)),
                                np.asarray(q_ref.astype(jnp.float32)))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(s_ref))
  assert reference.MIN_ROW_AMAX == quant_ops.MIN_ROW_AMAX and reference.FP8_MAX == quant_ops.FP8_MAX


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_lowers_at_maverick_shard_widths(arch):
  """TP8 shard widths: 640 (O-proj), 2048 (dense down), 1024 (shared-expert down), 5120 (QKV,
  MLP, experts), 16384 (the widest a row in registers takes)."""
  sd = jax.ShapeDtypeStruct
  for k in (640, 1024, 2048, 5120, 16384):
    text = pallas_kernels.lower_for_gpu(
        lambda x: qr.quantize_rows(x, 64, 1200.0, implementation="pallas"),
        sd((4, k), jnp.bfloat16), arch=arch)
    assert text.count("mosaic_gpu_v2(") == 1, k


def test_support_and_bad_input():
  assert qr.pallas_support(4, 5120, 64, jnp.bfloat16) == (True, "")
  assert not qr.pallas_support(4, 100, 64, jnp.bfloat16)[0]  # not a multiple of 128
  assert not qr.pallas_support(4, 128 * 256, 64, jnp.bfloat16)[0]  # too wide for registers
  assert not qr.pallas_support(2000, 5120, 2048, jnp.bfloat16)[0]  # prefill rows
  x = jnp.ones((4, 256), jnp.bfloat16)
  with pytest.raises(KernelInputError, match="rows_out=2 is fewer than x's 4 rows"):
    qr.quantize_rows(x, 2)
  with pytest.raises(KernelInputError, match=r"pass float rows \[M, K\]"):
    qr.quantize_rows(jnp.ones((2, 2, 256)))
  with pytest.raises(KernelInputError, match="ub=0"):
    qr.quantize_rows(x, 4, 0)


def _bf16_round(a):
  return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _np_swiglu(gate, up, x_scale, gate_scale, up_scale, m):
  """float64 SwiGLU of the GEMM outputs with the model's bf16 roundings (the products, silu(g),
  silu(g) * u: each a bf16 tensor in the model)."""
  def product(p, w_scale):
    acc = np.asarray(p, np.float64).sum(axis=0)
    if x_scale is not None:
      acc = acc * np.asarray(x_scale, np.float64)[:, None] * np.asarray(w_scale, np.float64)
    return _bf16_round(acc[:m])
  g, u = product(gate, gate_scale), product(up, up_scale)
  return _bf16_round(_bf16_round(g / (1 + np.exp(-g))) * u)


@pytest.mark.parametrize("splits,scaled,m,rows_out,ub",
                         [(3, True, 3, 8, None), (1, False, 2, 64, None), (2, True, 2, 4, 0.5)],
                         ids=["split3_scaled_padded", "finished_bf16", "ub_caps"])
def test_swiglu_quantize_matches_float64_in_interpret_mode(splits, scaled, m, rows_out, ub):
  """The down projection's FP8 input straight from gate / up GEMM outputs: f32 split-K partials
  with their epilogue scales (R = 8 > m rows: the GEMM's tile padding is not read), or finished
  bf16 products; pad rows are zero rows; a cap below the rows' max clips."""
  rng = np.random.default_rng(splits * 10 + m)
  r, n = 8, 1024
  dtype = jnp.float32 if scaled else jnp.bfloat16
  gate = jnp.asarray(rng.standard_normal((splits, r, n)) * 2, dtype)
  up = jnp.asarray(rng.standard_normal((splits, r, n)), dtype)
  scales = (None, None, None)
  if scaled:
    scales = tuple(jnp.asarray(rng.uniform(0.5, 2.0, k), jnp.float32) for k in (r, n, n))
  with pallas_kernels.interpret():
    q, s = qr.swiglu_quantize_rows(gate, up, *scales, m=m, rows_out=rows_out, ub=ub,
                                   implementation="pallas")
  h = _np_swiglu(gate, up, *scales, m)
  _check_swiglu(q, s, h, rows_out, ub)
  if rows_out > m:
    assert np.all(np.asarray(q[m:].astype(jnp.float32)) == 0)
  q_x, s_x = qr.swiglu_quantize_rows(gate, up, *scales, m=m, rows_out=rows_out, ub=ub,
                                     implementation="xla")
  _check_swiglu(q_x, s_x, h, rows_out, ub)  # the XLA reference: the same float64 oracle


def _check_swiglu(q, s, h, rows_out, ub):
  """As `_check`, with one bf16 step of slack on h: silu(g) and silu(g) * u are rounded to bf16
  after an f32 (kernel) or float64 (oracle) computation, so a value at a rounding boundary may
  land one bf16 step (2**-8 relative) apart, a row's max too. Codes are compared against h / the
  kernel's own scale."""
  want_scaled, want_s = _np_quantize(h, rows_out, ub)
  assert q.shape == (rows_out, h.shape[1]) and q.dtype == FP8 and s.shape == (rows_out,)
  np.testing.assert_allclose(np.asarray(s), want_s, rtol=2.0 ** -7)
  s64 = np.asarray(s, np.float64)
  h_pad = np.concatenate([h, np.zeros((rows_out - h.shape[0], h.shape[1]))])
  scaled = np.clip(h_pad / s64[:, None], -448, 448)
  codes = np.asarray(jnp.asarray(scaled, jnp.float32).astype(FP8).astype(jnp.float32))
  got = np.asarray(q.astype(jnp.float32))
  assert np.mean(got == codes) >= 0.97, np.mean(got == codes)
  step = np.maximum(np.abs(scaled) * (2.0 ** -3 + 2.0 ** -7), 2.0 ** -9)
  assert np.all(np.abs(got - scaled) <= step)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_swiglu_quantize_lowers_at_maverick_shard_widths(arch):
  """TP8 shard widths: 2048 (dense MLP), 1024 (shared expert); 4 split-K partials."""
  sd = jax.ShapeDtypeStruct
  for n in (1024, 2048):
    text = pallas_kernels.lower_for_gpu(
        lambda g, u, xs, gs, us: qr.swiglu_quantize_rows(g, u, xs, gs, us, m=1, rows_out=64,
                                                         ub=1200.0, implementation="pallas"),
        sd((4, 64, n), jnp.float32), sd((4, 64, n), jnp.float32), sd((64,), jnp.float32),
        sd((n,), jnp.float32), sd((n,), jnp.float32), arch=arch)
    assert text.count("mosaic_gpu_v2(") == 1, n


def test_swiglu_quantize_bad_input():
  g = jnp.ones((2, 4, 256), jnp.float32)
  with pytest.raises(KernelInputError, match="must be the same"):
    qr.swiglu_quantize_rows(g, g[:1], m=2, rows_out=4)
  with pytest.raises(KernelInputError, match="together, or none"):
    qr.swiglu_quantize_rows(g, g, jnp.ones((4,)), m=2, rows_out=4)
  with pytest.raises(KernelInputError, match="rows_out >= m"):
    qr.swiglu_quantize_rows(g, g, m=3, rows_out=2)
  with pytest.raises(KernelInputError, match=r"expected x \[4\]"):
    qr.swiglu_quantize_rows(g, g, jnp.ones((3,)), jnp.ones((256,)), jnp.ones((256,)), m=2,
                            rows_out=4)


@pytest.mark.parametrize("ub", [None, 0.5], ids=["no_cap", "ub_caps"])
def test_swiglu_and_rows_in_one_launch_match_float64(ub):
  """A MoE layer's shared-expert SwiGLU rows and its routed experts' down input rows quantized in
  one launch: each output as its own op's float64 oracle (and the two XLA references)."""
  rng = np.random.default_rng(21)
  gate = jnp.asarray(rng.standard_normal((3, 8, 1024)) * 2, jnp.float32)
  up = jnp.asarray(rng.standard_normal((3, 8, 1024)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((5, 256)), jnp.bfloat16)
  kw = dict(m=2, rows_out=8, rows_out_x=8, ub=ub)
  with pallas_kernels.interpret():
    hq, hs, xq, xs = qr.swiglu_and_quantize_rows(gate, up, x, implementation="pallas", **kw)
  h = _np_swiglu(gate, up, None, None, None, 2)
  _check_swiglu(hq, hs, h, 8, ub)
  _check(xq, xs, np.asarray(x, np.float64), 8, ub)
  assert not np.asarray(xq[5:].astype(jnp.float32)).any()
  refs = qr.swiglu_and_quantize_rows(gate, up, x, implementation="xla", **kw)
  _check_swiglu(*refs[:2], h, 8, ub)
  _check(*refs[2:], np.asarray(x, np.float64), 8, ub)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_swiglu_and_rows_lower_at_the_maverick_moe_shard(arch):
  """TP8: the shared expert's 1024 columns (8 K-split partials of a 64-row tile) and the routed
  experts' 1024-wide SwiGLU rows."""
  sd = jax.ShapeDtypeStruct
  text = pallas_kernels.lower_for_gpu(
      lambda g, u, x: qr.swiglu_and_quantize_rows(g, u, x, m=1, rows_out=64, rows_out_x=64,
                                                  implementation="pallas"),
      sd((8, 64, 1024), jnp.float32), sd((8, 64, 1024), jnp.float32),
      sd((64, 1024), jnp.bfloat16), arch=arch)
  assert text.count("mosaic_gpu_v2(") == 1


def test_swiglu_and_rows_bad_input():
  g, x = jnp.ones((2, 4, 256), jnp.float32), jnp.ones((3, 256), jnp.bfloat16)
  with pytest.raises(KernelInputError, match=r"expected \[S, R, N\] twice and \[M, K\]"):
    qr.swiglu_and_quantize_rows(g, g[:1], x, m=2, rows_out=4, rows_out_x=4)
  with pytest.raises(KernelInputError, match=r"rows_out_x=2 for 4 and 3 rows"):
    qr.swiglu_and_quantize_rows(g, g, x, m=2, rows_out=4, rows_out_x=2)
  with pytest.raises(KernelInputError, match=r"ub=-1.0"):
    qr.swiglu_and_quantize_rows(g, g, x, m=2, rows_out=4, rows_out_x=4, ub=-1.0)
