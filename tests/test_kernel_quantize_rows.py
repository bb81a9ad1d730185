"""pallas_kernels.quantize_rows: the per-row FP8 quantize kernel in GPU interpret mode against a
float64 NumPy quantizer written here, its XLA reference against maverick.quant's (the model's
XLA path: bit-equal), lowering for sm_90 / sm_100 at the Maverick TP8 shard widths, and bad
input.

Tolerance: the kernel and NumPy see the same input; scales agree to f32 rounding (measured
2e-7 relative, bound 1e-5); an e4m3 value may differ by one code where x / s lands within f32 rounding of a
rounding boundary, so codes are compared by agreement (>= 99 %) and the dequantized rows within
one e4m3 step (2**-3 relative to the value, 2**-9 * 448 s near zero)."""

import jax
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
