"""maverick.fused_mlp: an FP8 SwiGLU MLP as gate/up GEMM -> SwiGLU + FP8 quantize -> down GEMM.

References: a float64 NumPy MLP written here (per-token e4m3 quantization of x and of the SwiGLU
rows, dequantized FP8 weights, the model's bf16 roundings of g, u, silu(g), silu(g) * u and the
output) and the einsum path (`kernels="xla"`). Tolerance ("FP8 by agreement"): both sides quantize
the same values, but where f32 and float64 (or XLA's bf16 silu) land a value one bf16 step
apart at a row's max, that row's scale moves and every code of the row re-rounds (half an e4m3
step, 2**-4, per element). Measured on 3 rows x D 1024, seeds 0-2 (EPYC): kernels vs float64
0 (equal after the bf16 output), the einsum path vs float64 0.5-1.8 %; bound 5 %. Mutants: the
SwiGLU kernel summing one split-K partial of two, 88 % off; gate and up swapped, 80 % or more"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels
from maverick import config as config_lib
from maverick import fused_mlp
from maverick import kernel_moe
from maverick import kernels as kernels_lib
from maverick import model as model_lib
from maverick import moe
from maverick import quant
from maverick import sharding
from pallas_kernels import common, quantize_rows
from test_sharded_kernels import reference_kernels  # noqa: F401 (fixture)

REL_TOL = 5e-2


def _bf16(a):
  return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _e4m3(a):
  return np.asarray(a, np.float64).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _quantize_rows64(x, ub=None):
  amax = np.maximum(np.abs(x).max(axis=-1, keepdims=True), 1 / 512)
  if ub is not None:
    amax = np.minimum(amax, ub)
  s = amax / 448
  return _e4m3(np.clip(x / s, -448, 448)), s


def _np_mlp(x, gate, up, down, s_gate, s_up, s_down, shards=1):
  """float64; weights stored K-major (gate / up [F, D], down [D, F]) with per-channel scales.
  `shards`: the down projection runs per F slice (tensor parallel): each device quantizes its
  slice of silu(g) * u per row and its bf16 partial product is summed."""
  def w(a, s):
    return np.asarray(a.astype(jnp.float32), np.float64) * np.asarray(s, np.float64)[:, None]
  x = np.asarray(x.astype(jnp.float32), np.float64).reshape(-1, x.shape[-1])
  xq, xs = _quantize_rows64(x)
  g = _bf16(xq @ w(gate, s_gate).T * xs)
  u = _bf16(xq @ w(up, s_up).T * xs)
  h = _bf16(_bf16(g / (1 + np.exp(-g))) * u)
  wd = w(down, s_down)
  y = 0
  for cols in np.split(np.arange(h.shape[1]), shards):
    hq, hs = _quantize_rows64(h[:, cols])
    y = y + _bf16(hq @ wd[:, cols].T * hs)
  return y


def _weights(rng, d, f):
  def fp8(shape, in_axes):
    w = rng.standard_normal(shape).astype(np.float32) / math.sqrt(shape[0])
    q, s = quant.quantize_weight(w, in_axes)
    return quant.to_kmajor(q, in_axes), s
  (g, sg), (u, su), (dn, sd) = fp8((d, f), (0,)), fp8((d, f), (0,)), fp8((f, d), (0,))
  return (g, u, dn), (sg, su, sd)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_fused_mlp_matches_float64_and_the_einsum_path_in_interpret_mode(monkeypatch):
  """3 rows (padded to the GEMM tile inside), D 1024, F 256; 8 interpreted SMs: the gate/up GEMM
  splits K in two, so the SwiGLU kernel sums f32 partials and applies the scales itself."""
  monkeypatch.setattr(common, "INTERPRET_NUM_SMS", 8)
  seen = []
  original = quantize_rows.swiglu_quantize_rows
  monkeypatch.setattr(quantize_rows, "swiglu_quantize_rows",
                      lambda g, *a, **k: seen.append((g.shape, g.dtype)) or original(g, *a, **k))
  rng = np.random.default_rng(0)
  (gate, up, down), scales = _weights(rng, 1024, 256)
  x = jnp.asarray(rng.standard_normal((3, 1024)) * rng.uniform(0.5, 4.0, (3, 1)), jnp.bfloat16)
  qc = quant.QuantConfig()
  with pallas_kernels.interpret(detect_races=False):
    got = fused_mlp.swiglu(x, gate, up, down, scales, qc, "pallas")
  assert got is not None and got.shape == x.shape and got.dtype == jnp.bfloat16
  assert seen == [((2, 64, 256), jnp.float32)], seen
  want = _np_mlp(x, gate, up, down, *scales)
  assert _rel(got.astype(jnp.float32).reshape(want.shape), want) < REL_TOL
  xla = moe.swiglu(x, gate, up, down, scales, qc, "xla")
  assert _rel(got.astype(jnp.float32), xla.astype(jnp.float32)) < REL_TOL


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_fused_mlp_is_four_kernels_or_three_after_a_quantizing_site(arch):
  """quantize x, gate/up, SwiGLU + quantize, down; the fused site's FP8 rows save the first.
  The einsum path: 5 (its SwiGLU is an XLA fusion, then its own quantize kernel)."""
  rng = np.random.default_rng(1)
  (gate, up, down), scales = _weights(rng, 256, 512)
  qc = quant.QuantConfig()
  sd = jax.ShapeDtypeStruct
  x = sd((1, 256), jnp.bfloat16)

  def mosaic(fn, *args):
    return pallas_kernels.lower_for_gpu(fn, *args, arch=arch).count("mosaic_gpu_v2(")

  with kernels_lib.fused_forward():
    assert mosaic(lambda x: fused_mlp.swiglu(x, gate, up, down, scales, qc, "pallas"), x) == 4

    def after_site(x, q, s):
      kernels_lib.remember_quantized(x, q, s, qc.activation_scale_ub)
      return fused_mlp.swiglu(x, gate, up, down, scales, qc, "pallas")
    tile = 64 if arch == "sm90" else 128
    assert mosaic(after_site, x, sd((tile, 256), quant.FP8), sd((tile,), jnp.float32)) == 3


def test_fused_mlp_declines_what_it_does_not_take():
  rng = np.random.default_rng(2)
  (gate, up, down), scales = _weights(rng, 256, 512)
  x = jnp.ones((2, 256), jnp.bfloat16)
  qc = quant.QuantConfig()
  assert fused_mlp.swiglu(x, gate, up, down, scales, qc, "xla") is None
  assert fused_mlp.swiglu(x, gate, up, down, (None,) * 3, qc, "pallas") is None  # bf16
  static = quant.QuantConfig(activations="static_per_tensor")
  assert fused_mlp.swiglu(x, gate, up, down, scales, static, "pallas",
                          input_scales=(jnp.float32(0.1),) * 3) is None


def _tp8_fp8_model():
  cfg = config_lib.tiny("bfloat16").replace(
      hidden_size=128, head_dim=64, num_attention_heads=8, num_key_value_heads=8,
      intermediate_size=1024, intermediate_size_mlp=1024, num_hidden_layers=2,
      no_rope_layers=None, moe_layers=None, layer_types=None, attention_chunk_size=64)
  model = quant.quantize_model(model_lib.init_model(cfg, seed=0), quant.QuantConfig())
  return sharding.shard_model(model, sharding.make_mesh(tensor=8), "tp")


@pytest.mark.slow
def test_tp8_mlp_runs_one_shard_map_of_local_kernels(reference_kernels):
  """A TP8-sharded FP8 dense MLP and MoE shared expert: inside one shard_map the gate/up GEMM,
  the SwiGLU + quantize op and the down GEMM run on each device's F / 8 = 128 columns, and the
  MLP's output equals the sharded einsum path's. (Multi-device interpret mode does not run Mosaic
  kernels reliably: the entries run their XLA references, as in test_sharded_kernels; the
  kernels' math is tested above.)"""
  model = _tp8_fp8_model()
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((2, 3, 128)), jnp.bfloat16)
  for mlp in (model.layers[0].ffn, model.layers[1].ffn.shared):
    kernels_lib.set_kernels(model, "xla")
    want = mlp(x)
    assert not reference_kernels
    with pallas_kernels.interpret():
      kernels_lib.set_kernels(model, "pallas")
      got = mlp(x)
    calls = [(name, shapes) for name, shapes, *_ in reference_kernels]
    reference_kernels.clear()
    calls = calls[len(calls) // 2:]  # traced twice: the support check's eval_shape, then the run
    names = [name for name, _ in calls]
    assert names == ["quantize_rows", "gemm_many_partials", "swiglu_quantize_rows", "gemm"], names
    assert calls[1][1][1:3] == ((128, 128), (128, 128)), calls  # gate / up [F / 8, D]
    assert calls[2][1][0][-1] == 128 and calls[3][1][1] == (128, 128), calls  # down [D, F / 8]
    weights = (mlp.gate[...], mlp.up[...], mlp.down[...])
    scales = (mlp.gate_scale[...], mlp.up_scale[...], mlp.down_scale[...])
    oracle = _np_mlp(x, *weights, *scales, shards=8)
    assert _rel(got.astype(jnp.float32).reshape(oracle.shape), oracle) < REL_TOL
    # The einsum path quantizes silu(g) * u per whole row (GSPMD), the shards per slice: two FP8
    # roundings of the same product, each ~2**-4 per element (~3 % apart measured).
    assert _rel(got.astype(jnp.float32), want.astype(jnp.float32)) < 0.1


@pytest.mark.slow
def test_tp8_moe_site_takes_the_routed_and_shared_products_as_two_terms(reference_kernels,
                                                                         monkeypatch):
  """The MoE layer's fused site sums the routed experts' rows and the shared expert's down
  product itself (two terms, no XLA add): its call gets both, and prefill and decode logits
  equal the run where the layer adds them first (the same bf16 products summed in f32 and
  rounded once either way). Entries run their XLA references (see above)."""
  from test_sharded_kernels import _prefill_then_decode
  model = _tp8_fp8_model()
  tokens = jnp.asarray(np.random.default_rng(4).integers(0, 512, (2, 12)), jnp.int32)

  def run():
    jax.clear_caches()
    with pallas_kernels.interpret():
      kernels_lib.set_kernels(model, "pallas")
      out = _prefill_then_decode(model, tokens)
    terms = [len(shapes) for name, shapes, *_ in reference_kernels
             if name == "allreduce_residual_norm"]
    merged = sum(name == "swiglu_and_quantize_rows" for name, *_ in reference_kernels)
    reference_kernels.clear()
    return out, terms, merged

  (prefill, step), terms, merged = run()
  # Decode's MoE site: the shared expert's SwiGLU rows and the routed experts' down input in one
  # launch (prefill sorts its rows by expert: its own quantize launches).
  assert merged == 1, merged
  with monkeypatch.context() as m:  # the two quantize launches apart: the same numbers
    m.setattr(kernel_moe, "_takes_shared", lambda *a, **k: False)
    (prefill1, step1), terms1, merged1 = run()
  assert merged1 == 0 and terms1 == terms
  np.testing.assert_array_equal(step, step1)
  with monkeypatch.context() as m:
    m.setattr(fused_mlp, "local_partials", lambda *a, **k: None)
    m.setattr(fused_mlp, "shared_gate_up", lambda *a, **k: None)
    (prefill0, step0), terms0, _ = run()
  # (partials..., residual, weight[, semaphores]): the MoE site (1 of 5 per forward) has one more.
  assert sorted(set(terms)) == [min(terms), min(terms) + 1] and set(terms0) == {min(terms)}
  assert terms.count(min(terms) + 1) == 2, terms  # the MoE layer's site, prefill and decode
  np.testing.assert_array_equal(prefill, prefill0)
  np.testing.assert_array_equal(step, step0)


def test_self_check_compares_finished_products_for_a_fused_site(monkeypatch, tmp_path):
  """Auto mode: the probe of the MLP a fused site takes as K-split partials (8 interpreted SMs:
  the down GEMM splits K in two) compares the finished [rows, D] products of both paths (the
  site's [2, R, D] partials and XLA's [1, R, D] product differ in shape), passes, and the
  kernels run: no KernelFallbackWarning. Mutant: the probe run keeping the partials."""
  import warnings
  from pallas_kernels import selfcheck
  monkeypatch.setenv("MAVERICK_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(common, "INTERPRET_NUM_SMS", 8)
  rng = np.random.default_rng(7)
  (gate, up, down), scales = _weights(rng, 256, 1024)
  x = jnp.asarray(rng.standard_normal((3, 256)), jnp.bfloat16)
  selfcheck.clear_memory()
  with (pallas_kernels.interpret(detect_races=False), selfcheck.force(),
        warnings.catch_warnings(record=True) as ws):
    warnings.simplefilter("always")
    partials = fused_mlp.local_partials(x, gate, up, down, *scales, quant=quant.QuantConfig(),
                                        kernels=None)
  assert not [w for w in ws if issubclass(w.category, selfcheck.KernelFallbackWarning)], [str(w.message) for w in ws]
  assert selfcheck.probes_run == 1 and partials is not None and partials.shape == (2, 64, 256)
  selfcheck.clear_memory()
