"""The FP8 quantize epilogue of decode attention's split-KV combine kernel
(pallas_kernels/decode_attention/combine.py, `quantize=(rows_out, ub)`): the O-projection's
per-token FP8 input [rows_out, H * Dh] written by the combine itself.

References (written here, float64 NumPy): the split combine (online log-sum-exp over the P
partials, as tests/test_kernel_decode_attention.py) and the per-row quantizer of
tests/test_kernel_quantize_rows.py (s = clip(max |x|, 1/512, ub) / 448, x / s clipped to +-448,
rows past B * T zero rows). End to end, the kernel path is compared with implementation="xla"
(the reference attention + quantize_rows' XLA reference); lowering for sm_90 / sm_100 at a
Maverick TP8 shard; bad input.

Tolerances: y is bf16 (partials and output rounded to bf16: atol = rtol = 2e-2 against float64,
as the decode-attention tests). The kernel quantizes the bf16-ROUNDED y, so q / s are checked
against the NumPy quantizer applied to the kernel's own returned y (the same input): scales to
f32 rounding (rtol 1e-5; against the XLA path, whose y may differ by a bf16 ulp, rtol 1e-2);
codes by agreement (>= 99 %: x / s within f32 rounding of an e4m3 boundary may round either
way) and every dequantized value within one e4m3 step (2**-3 relative, 2**-9 near zero)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from pallas_kernels import KernelInputError
from pallas_kernels.decode_attention import combine as combine_kernel
from pallas_kernels.decode_attention import decode_attention, decode_attention_paged
from test_kernel_quantize_rows import _np_quantize

FP8 = jnp.float8_e4m3fn
ATOL = RTOL = 2e-2


def _np_combine(out, lse, B, K, T, G):
  """float64 merge of split partials -> [B, T, K * G, Dh] (rows seeing nothing are 0)."""
  o = np.asarray(out, np.float64)
  want = np.zeros((B, T, K * G, o.shape[-1]))
  for b in range(B):
    for k in range(K):
      for t in range(T):
        for g in range(G):
          l = lse[:, b * K + k, t * G + g]
          if np.all(np.isinf(l)):
            continue
          w = np.exp2(l - l.max())
          want[b, t, k * G + g] = (w[:, None] * o[:, b * K + k, t * G + g]).sum(0) / w.sum()
  return want


def _check_quantized(q, s, y, rows_out, ub, s_rtol=1e-5):
  """q, s against the NumPy quantizer of y's token rows (y [B, T, H, Dh])."""
  B, T, H, Dh = y.shape
  x = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64).reshape(B * T, H * Dh)
  want_scaled, want_s = _np_quantize(x, rows_out, ub)
  assert q.shape == (rows_out, H * Dh) and q.dtype == FP8, (q.shape, q.dtype)
  assert s.shape == (rows_out,) and s.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(s), want_s, rtol=s_rtol)
  codes = np.asarray(jnp.asarray(want_scaled, jnp.float32).astype(FP8).astype(jnp.float32))
  got = np.asarray(q.astype(jnp.float32))
  assert np.mean(got == codes) >= 0.99, np.mean(got == codes)
  step = np.maximum(np.abs(want_scaled) * 2.0 ** -3, 2.0 ** -9)
  assert np.all(np.abs(got - want_scaled) <= step)


def _check_pad_rows(q, s, tokens, ub):
  floor = min(1 / 512, ub) / 448 if ub is not None else 1 / 512 / 448
  assert np.all(np.asarray(q[tokens:].astype(jnp.float32)) == 0)
  np.testing.assert_allclose(np.asarray(s[tokens:]), floor, rtol=1e-6)


# (P, B, K, T, G, rows_out, ub): 5 heads a token (Maverick TP8: K = 1, G = 5), B * T = 4 token
# rows padded to 8; K = 2 (H = 2 * G: heads of two kv heads in one token row) with a cap below
# the rows' max (values clip at +-448) and a cap below the floor (pad rows' scale is ub / 448).
COMBINE_CASES = [
    pytest.param(4, 2, 1, 2, 5, 8, None, id="k1_g5_padded"),
    pytest.param(3, 2, 2, 2, 3, 8, 1.5, id="k2_g3_ub_caps"),
    pytest.param(2, 1, 2, 3, 2, 5, 1e-3, id="k2_g2_ub_below_floor"),
]


@pytest.mark.parametrize("P,B,K,T,G,rows_out,ub", COMBINE_CASES)
def test_combine_quantize_matches_float64(P, B, K, T, G, rows_out, ub):
  """The combine kernel with quantize in GPU interpret mode: y against the float64 combine, q / s
  against the NumPy quantizer of y's token rows, pad rows zero with the floor scale. Scale
  varies per (row, head) so the token's max comes from different heads in different rows; one
  split is empty and one packed row sees nothing (that head comes out 0)."""
  rng = np.random.default_rng(100 * K + G)
  Dh, Mpad = 128, 64
  out = rng.standard_normal((P, B * K, Mpad, Dh)) * rng.uniform(0.2, 3.0, (1, B * K, Mpad, 1))
  out[:, 0, G + 1, 5] = 9.0  # an outlier: token (0, 1)'s max, from head g = 1 (clips under ub)
  out = jnp.asarray(out, jnp.bfloat16)
  lse = rng.standard_normal((P, B * K, Mpad)) * 4
  lse[1] = -np.inf  # an empty split
  lse[:, B * K - 1, 0] = -np.inf  # last kv head of the last batch row, t = 0, g = 0: sees nothing
  with pallas_kernels.interpret():
    y, q, s = combine_kernel.combine_rows(out, jnp.asarray(lse, jnp.float32), batch=B, steps=T,
                                          groups=G, out_dtype=jnp.bfloat16,
                                          quantize=(rows_out, ub))
    y_plain = combine_kernel.combine_rows(out, jnp.asarray(lse, jnp.float32), batch=B, steps=T,
                                          groups=G, out_dtype=jnp.bfloat16)
  assert y.shape == (B, T, K * G, Dh) and y.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(y, np.float64), _np_combine(out, lse, B, K, T, G),
                             atol=ATOL, rtol=RTOL)
  # The quantize grid's y is the per-row grid's (bit for bit on the hosts seen; another host's
  # XLA:CPU may contract the same multiply-adds into FMAs differently: one bf16 step allowed).
  np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)),
                             np.asarray(y_plain.astype(jnp.float32)), rtol=2.0 ** -7, atol=0)
  assert np.all(np.asarray(y)[B - 1, 0, (K - 1) * G] == 0)
  _check_quantized(q, s, y, rows_out, ub)
  _check_pad_rows(q, s, B * T, ub)
  if ub is not None:  # the cap bites: many values a row clip to +-448, not just the max
    assert np.all(np.sum(np.abs(np.asarray(q[:B * T].astype(jnp.float32))) == 448, 1) > 1)


def test_supports_quantize():
  assert combine_kernel.supports_quantize(5, 128)  # TP8 Maverick: 5 values a thread
  assert combine_kernel.supports_quantize(40, 128)  # all 40 heads: 40 a thread
  assert combine_kernel.supports_quantize(64, 256)  # 128 a thread: the register bound
  assert not combine_kernel.supports_quantize(129, 128)
  assert not combine_kernel.supports_quantize(5, 64)  # Dh < a warpgroup: the XLA combine


def _small_case(seed, B=2, T=2, H=5, K=1, Dh=128, S=128):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(B, S, K, Dh)), jnp.bfloat16)
  v = jnp.asarray(rng.normal(size=(B, S, K, Dh)) * rng.uniform(0.5, 4.0, (B, S, K, 1)),
                  jnp.bfloat16)
  pos = jnp.asarray([[70, 71], [100, 101]][:B], jnp.int32)[:, :T]
  return q, k, v, pos


def _check_against_xla(got, want, rows_out, ub):
  y, q, s = got
  y_x, q_x, s_x = want
  tokens = y.shape[0] * y.shape[1]
  np.testing.assert_allclose(np.asarray(y, np.float64), np.asarray(y_x, np.float64),
                             atol=ATOL, rtol=RTOL)
  _check_quantized(q, s, y, rows_out, ub)  # exact math on the kernel's own y
  # Against the XLA path: its y may differ by bf16 roundings, so the scales by ~1e-2.
  np.testing.assert_allclose(np.asarray(s), np.asarray(s_x), rtol=1e-2)
  assert q.shape == q_x.shape and s.shape == s_x.shape
  _check_pad_rows(q, s, tokens, ub)


@pytest.mark.parametrize("ub", [None, 0.6], ids=["no_cap", "ub_caps"])
def test_decode_attention_quantize_matches_xla(ub):
  """End to end on a small bf16 cache (Dh = 128, K = 1, G = 5, 2 splits): the split kernel and
  the combine with its quantize epilogue against implementation="xla"; ub = 0.6 is below the
  rows' max |y| (~1-4), so values clip."""
  q, k, v, pos = _small_case(11)
  rows_out = 8
  with pallas_kernels.interpret():
    got = decode_attention(q, k, v, pos, num_splits=2, implementation="pallas",
                           quantize=(rows_out, ub))
  want = decode_attention(q, k, v, pos, implementation="xla", quantize=(rows_out, ub))
  _check_against_xla(got, want, rows_out, ub)
  if ub is not None:  # the cap bites: many values a row clip to +-448
    assert np.all(np.sum(np.abs(np.asarray(got[1][:4].astype(jnp.float32))) == 448, 1) > 1)


def test_decode_attention_paged_quantize_and_fallback(monkeypatch):
  """decode_attention_paged with quantize (pool of 64-slot blocks, shuffled table), and the XLA
  quantization after the kernel combine where supports_quantize declines: both match "xla"."""
  B, T, H, K, Dh, S, bs = 1, 2, 4, 2, 128, 128, 64
  q, k, v, pos = _small_case(12, B=B, T=T, H=H, K=K, Dh=Dh, S=S)
  table = jnp.asarray([[1, 0]], jnp.int32)  # logical block j lives in pool block table[j]
  pool = lambda x: x.reshape(S // bs, bs, K, Dh)[jnp.argsort(table[0])]
  rows_out, ub = 4, 2.0
  want = decode_attention(q, k, v, pos, implementation="xla", quantize=(rows_out, ub))
  with pallas_kernels.interpret():
    got = decode_attention_paged(q, pool(k), pool(v), table, pos, num_splits=1,
                                 implementation="pallas", quantize=(rows_out, ub))
    _check_against_xla(got, want, rows_out, ub)
    asked = []
    monkeypatch.setattr(combine_kernel, "supports_quantize",
                        lambda heads, dh: asked.append((heads, dh)) and False)
    got = decode_attention(q, k, v, pos, num_splits=1, implementation="pallas",
                           quantize=(rows_out, ub))
  assert asked == [(H, Dh)]  # traced afresh: the fallback ran, not a cached kernel call
  _check_against_xla(got, want, rows_out, ub)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_lowers_at_maverick_tp8_shard(arch):
  """A Maverick TP8 shard (5 local heads, one kv head, Dh = 128) over an 8192-slot cache: two
  Mosaic kernels (the split kernel and the combine with its quantize epilogue), no third."""
  sd = jax.ShapeDtypeStruct
  args = [sd((1, 1, 5, 128), jnp.bfloat16), sd((1, 8192, 1, 128), jnp.bfloat16),
          sd((1, 8192, 1, 128), jnp.bfloat16), sd((1, 1), jnp.int32)]

  def f(q, k, v, pos):
    return decode_attention(q, k, v, pos, implementation="pallas", quantize=(64, 1200.0))
  text = pallas_kernels.lower_for_gpu(f, *args, arch=arch)
  assert text.count("mosaic_gpu_v2(") == 2, text.count("mosaic_gpu_v2(")
  # The FP8 rows come out of the combine kernel itself (not an XLA quantize after it).
  combine_call = pallas_kernels.common.mosaic_call_lines(text)[-1]
  assert combine_call.endswith("-> (tensor<1x1x5x128xbf16>, tensor<64x5x128xf8E4M3FN>, "
                               "tensor<64xf32>)"), combine_call[-200:]


@pytest.mark.parametrize("quantize,match", [
    ((3, None), r"rows_out=3 is fewer than the B\*T=4 token rows"),
    ((8, 0.0), "ub=0.0; pass a positive cap"),
    ((8, -1.0), "ub=-1.0; pass a positive cap"),
    (8, r"pass \(rows_out, ub\) or None"),
])
def test_bad_quantize_raises(quantize, match):
  q, k, v, pos = _small_case(13)
  with pallas_kernels.interpret(), pytest.raises(KernelInputError, match=match):
    decode_attention(q, k, v, pos, implementation="pallas", quantize=quantize)
  table = jnp.asarray([[0, 1]] * 2, jnp.int32)
  with pytest.raises(KernelInputError, match=match):
    decode_attention_paged(q, k.reshape(4, 64, 1, 128), v.reshape(4, 64, 1, 128), table, pos,
                           implementation="xla", quantize=quantize)
