"""FP8 primitives against float64 NumPy references (ml_dtypes does the e4m3 rounding there)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from maverick import config as config_lib
from maverick import quant
from maverick.config import ConfigError

E4M3 = ml_dtypes.float8_e4m3fn


def _weights(shape, in_axes, seed=0):
  """Random weights whose output channels span six orders of magnitude."""
  rng = np.random.default_rng(seed)
  w = rng.standard_normal(shape)
  out_shape = [1 if i in in_axes else n for i, n in enumerate(shape)]
  return w * 10.0 ** rng.uniform(-3, 3, out_shape)


@pytest.mark.parametrize("shape,in_axes", [((64, 48), (0,)), ((6, 40, 24), (1,)),
                                           ((4, 8, 32), (0, 1)), ((48, 64), (1,))])
def test_weight_round_trip_error_bounded_per_channel(shape, in_axes):
  w64 = _weights(shape, in_axes)
  w32 = w64.astype(np.float32)
  q, s = quant.quantize_weight(w32, in_axes)
  assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
  out_shape = tuple(n for i, n in enumerate(shape) if i not in in_axes)
  assert s.shape == out_shape
  # float64 reference: scale = max|w| / 448 per output channel.
  amax = np.max(np.abs(w64), axis=in_axes)
  np.testing.assert_allclose(np.asarray(s, np.float64), amax / 448.0, rtol=1e-6)
  deq = np.asarray(quant.dequantize(q, s, in_axes), np.float64)
  s_b = np.expand_dims(amax / 448.0, in_axes)
  err = np.abs(deq - w64)
  # e4m3 has 3 mantissa bits: half an ulp is 2^-4 of the value's binade; below the smallest
  # normal (2^-6) the spacing is 2^-9, so the absolute floor is 2^-10 in scaled units.
  assert np.all(err <= np.abs(w64) * 2.0 ** -4 + s_b * 2.0 ** -10 + 1e-7 * np.abs(w64))
  per_channel = np.max(err, axis=in_axes)
  assert np.all(per_channel <= amax * 2.0 ** -4 * 1.0001)
  # Rounding agrees with an independent float64 -> e4m3 cast (round to nearest even).
  ref_q = (w64 / s_b).astype(E4M3)
  assert np.mean(np.asarray(q).view(np.uint8) == ref_q.view(np.uint8)) > 0.999


def test_zero_channel_has_unit_scale_and_no_nan():
  w = _weights((32, 8), (0,)).astype(np.float32)
  w[:, 3] = 0
  q, s = quant.quantize_weight(w, (0,))
  assert float(s[3]) == 1.0
  assert np.all(np.asarray(q[:, 3], np.float32) == 0)
  assert np.isfinite(np.asarray(quant.dequantize(q, s, (0,)))).all()


def test_row_quantization_zero_and_huge_rows():
  x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
  x[1] = 0.0
  x[2] *= 1e30
  x[3] = np.finfo(np.float32).max
  x[4, :] = -np.finfo(np.float32).max
  q, s = quant.quantize_rows(x)
  qf = np.asarray(q, np.float32)
  assert np.isfinite(qf).all() and np.isfinite(np.asarray(s)).all()
  assert np.all(qf[1] == 0) and float(s[1]) == pytest.approx(quant.MIN_ROW_AMAX / 448)
  deq = qf * np.asarray(s)[:, None]
  np.testing.assert_allclose(deq[2], x[2], rtol=2 ** -4)
  np.testing.assert_allclose(deq[3], x[3], rtol=2 ** -4)
  # bf16 input with the largest bf16 values is fine too.
  big = float(jnp.finfo(jnp.bfloat16).max)
  qb, sb = quant.quantize_rows(jnp.asarray([[big, -big, 1.0], [-big, 0.0, 0.0]], jnp.bfloat16))
  assert np.isfinite(np.asarray(qb, np.float32)).all() and np.isfinite(np.asarray(sb)).all()


def test_activation_scale_upper_bound_saturates():
  x = np.array([[2000.0, 100.0, -3000.0, 1.0]], np.float32)
  q, s = quant.quantize_rows(x, ub=1200.0)
  assert float(s[0]) == pytest.approx(1200.0 / 448)
  deq = np.asarray(q, np.float32) * float(s[0])
  np.testing.assert_allclose(deq, [[1200.0, 100.0, -1200.0, 1.0]], rtol=2 ** -4)


def _ref_rows(x64, axes):
  """float64 per-token activation quantization (the spec of ops.quantize_rows)."""
  amax = np.maximum(np.max(np.abs(x64), axis=axes, keepdims=True), 1 / 512)
  s = amax / 448
  return np.clip(x64 / s, -448, 448).astype(E4M3).astype(np.float64) * s


@pytest.mark.parametrize("spec,xs,ws,in_axes,x_axes", [
    ("btd,dhk->bthk", (2, 5, 32), (32, 4, 8), (0,), (2,)),
    ("bthk,hkd->btd", (2, 5, 4, 8), (4, 8, 32), (0, 1), (2, 3)),
    ("...d,vd->...v", (2, 5, 32), (40, 32), (1,), (2,)),
    ("...f,fd->...d", (7, 24), (24, 16), (0,), (1,)),
])
@pytest.mark.parametrize("activations", ["none", "dynamic_per_token"])
def test_einsum_matches_float64_reference(spec, xs, ws, in_axes, x_axes, activations):
  rng = np.random.default_rng(2)
  x64 = rng.standard_normal(xs)
  w64 = _weights(ws, in_axes, seed=3)
  q, s = quant.quantize_weight(w64.astype(np.float32), in_axes)
  w_deq = np.asarray(quant.dequantize(q, s, in_axes), np.float64)
  qc = quant.QuantConfig(activations=activations)
  # FP8 weights are stored K-major; the spec names the declared layout
  got = np.asarray(quant.einsum(spec, jnp.asarray(x64, jnp.float32), quant.to_kmajor(q, in_axes),
                                s, qc), np.float64)
  x_ref = _ref_rows(x64, x_axes) if activations != "none" else x64.astype(np.float32)
  want = np.einsum(spec, x_ref.astype(np.float64), w_deq)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("spec,xs,ws,in_axes", [
    ("btd,dhk->bthk", (2, 5, 32), (32, 4, 8), (0,)),
    ("bthk,hkd->btd", (2, 5, 4, 8), (4, 8, 32), (0, 1)),
])
def test_einsum_static_per_tensor_matches_float64_reference(spec, xs, ws, in_axes):
  """Static activation scale (ModelOpt FP8): e4m3(clip(x / s)) x FP8 weight, times s * w_scale;
  the scale is small enough that some inputs clip."""
  rng = np.random.default_rng(7)
  x64 = rng.standard_normal(xs)
  w64 = _weights(ws, in_axes, seed=8)
  q, s = quant.quantize_weight(w64.astype(np.float32), in_axes)
  w_deq = np.asarray(quant.dequantize(q, s, in_axes), np.float64)
  si = np.float32(np.abs(x64).max() / 448 / 1.5)
  qc = quant.QuantConfig(activations="static_per_tensor")
  got = np.asarray(quant.einsum(spec, jnp.asarray(x64, jnp.float32), quant.to_kmajor(q, in_axes),
                                s, qc, input_scale=jnp.float32(si)), np.float64)
  x_ref = np.clip(x64.astype(np.float32) / si, -448, 448).astype(E4M3).astype(np.float64) * si
  want = np.einsum(spec, x_ref, w_deq)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
  with pytest.raises(ValueError, match="input_scale"):
    quant.einsum(spec, jnp.asarray(x64, jnp.float32), quant.to_kmajor(q, in_axes), s, qc)


@pytest.mark.parametrize("shape,in_axes,stored", [
    ((32, 4, 8), (0,), (4, 8, 32)),          # q/k/v: D -> (H, Dh, D)
    ((4, 8, 32), (0, 1), (32, 4, 8)),        # o: (H, Dh) -> D
    ((6, 32, 16), (1,), (6, 16, 32)),        # experts: (E, D, F) -> (E, F, D)
    ((40, 32), (1,), (40, 32)),              # the embedding is K-major already
])
def test_kmajor_layout(shape, in_axes, stored):
  """Output axes first, contracted axes last, and from_kmajor undoes it."""
  w = np.random.default_rng(6).standard_normal(shape).astype(np.float32)
  k = quant.to_kmajor(w, in_axes)
  assert k.shape == stored
  out_axes = [a for a in range(len(shape)) if a not in in_axes]
  np.testing.assert_array_equal(k, np.transpose(w, out_axes + list(in_axes)))
  np.testing.assert_array_equal(quant.from_kmajor(k, in_axes), w)


def test_einsum_without_scale_is_jnp_einsum():
  x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 7, 16)), jnp.bfloat16)
  w = jnp.asarray(np.random.default_rng(5).standard_normal((16, 24)), jnp.bfloat16)
  a = quant.einsum("btd,df->btf", x, w, None, quant.QuantConfig())
  b = jnp.einsum("btd,df->btf", x, w)
  assert a.dtype == b.dtype
  np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_einsum_scale_shape_checked():
  q, s = quant.quantize_weight(np.ones((16, 8), np.float32), (0,))
  with pytest.raises(ValueError, match="per output channel"):
    quant.einsum("nd,df->nf", jnp.ones((2, 16)), q, s[None], quant.QuantConfig())


def test_kv_quantization_per_token_and_head():
  x = np.random.default_rng(6).standard_normal((2, 5, 3, 16)).astype(np.float32)
  x[0, 1, 2] = 0
  q, s = quant.quantize_kv(jnp.asarray(x))
  assert q.shape == x.shape and s.shape == (2, 5, 3)
  want = _ref_rows(x.astype(np.float64), (3,))
  np.testing.assert_allclose(np.asarray(q, np.float64) * np.asarray(s)[..., None], want,
                             rtol=1e-6, atol=1e-9)


def test_check_finite_names_tensor():
  with pytest.raises(quant.QuantError, match="layers.3.attn.q.*NaN/inf"):
    quant.check_finite("layers.3.attn.q", np.array([1.0, np.inf], np.float32))
  bad = np.array([1.0, 2.0], np.float32).astype(E4M3)
  bad.view(np.uint8)[1] = 0x7F  # the e4m3fn NaN encoding
  with pytest.raises(quant.QuantError, match="1 NaN/inf"):
    quant.check_finite("w", bad)
  quant.check_finite("ok", np.ones(3, np.float32))


# ----------------------------------------------------------------------------------------------
# QuantConfig
# ----------------------------------------------------------------------------------------------
def test_quant_config_skip_rules():
  qc = quant.QuantConfig()
  assert not qc.quantizes("embed") and not qc.quantizes("lm_head")
  assert not qc.quantizes("layers.3.router")
  assert qc.quantizes("layers.3.attn.q") and qc.quantizes("layers.3.experts.gate")
  qc = quant.QuantConfig(skip=("attn", "layers.7.experts.*"))
  assert not qc.quantizes("layers.0.attn.o") and qc.quantizes("layers.0.shared.up")
  assert not qc.quantizes("layers.7.experts.down") and qc.quantizes("layers.5.experts.down")
  assert qc.quantizes("embed")
  assert not quant.QuantConfig(weights=None).quantizes("layers.0.attn.q")


@pytest.mark.parametrize("kwargs,words", [
    (dict(weights="int4"), "weights 'int4'"), (dict(activations="static"), "activations"),
    (dict(kv_cache="int8"), "kv_cache"), (dict(skip="router"), "skip"),
    (dict(activation_scale_ub=-1.0), "activation_scale_ub")])
def test_quant_config_rejects_bad_values(kwargs, words):
  with pytest.raises(quant.QuantConfigError, match=words):
    quant.QuantConfig(**kwargs)


def test_config_records_quant():
  qc = quant.QuantConfig(kv_cache="fp8", skip=("router", "layers.1.experts.*"),
                         activation_scale_ub=1200.0)
  cfg = config_lib.tiny().replace(quant=qc)
  d = cfg.to_dict()
  assert d["quant"]["skip"] == ["router", "layers.1.experts.*"]
  back = config_lib.Config.from_dict(d)
  assert back == cfg and hash(back) == hash(cfg)
  assert config_lib.Config.from_dict(config_lib.tiny().to_dict()).quant is None
  bad = dict(d, quant=dict(d["quant"], weights="fp4"))
  with pytest.raises(ConfigError, match="quant"):
    config_lib.Config.from_dict(bad)
  with pytest.raises(ConfigError, match="QuantConfig"):
    config_lib.tiny().replace(quant={"weights": "fp8"})


def test_fp8_dot_is_jittable():
  q, s = quant.quantize_weight(np.ones((16, 8), np.float32), (0,))
  f = jax.jit(lambda x: quant.einsum("nd,df->nf", x, q.T, s, quant.QuantConfig()))
  assert f(jnp.ones((2, 16), jnp.bfloat16)).dtype == jnp.bfloat16


def test_attention_with_fp8_cache_equals_dequantized_cache():
  """Scales folded into scores/probabilities == attention over the dequantized cache."""
  from maverick import model as model_lib
  rng = np.random.default_rng(8)
  B, T, S, H, K, Dh = 2, 3, 10, 4, 2, 16
  q = jnp.asarray(rng.standard_normal((B, T, H, Dh)), jnp.float32)
  k = rng.standard_normal((B, S, K, Dh)) * rng.uniform(0.1, 10, (B, S, K, 1))
  v = rng.standard_normal((B, S, K, Dh))
  (kq, ks), (vq, vs) = quant.quantize_kv(jnp.asarray(k)), quant.quantize_kv(jnp.asarray(v))
  pos = jnp.asarray([[5, 6, 7], [7, 8, 9]], jnp.int32)
  mask = model_lib.attention_mask(pos, jnp.broadcast_to(jnp.arange(S), (B, S)), None)
  got = model_lib.attention(q, kq, vq, mask, k_scale=ks, v_scale=vs)
  deq = lambda x, s: (np.asarray(x, np.float64) * np.asarray(s)[..., None]).astype(np.float32)
  want = model_lib.attention(q, jnp.asarray(deq(kq, ks)), jnp.asarray(deq(vq, vs)), mask)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
