"""Static-scale FP8 (NVIDIA ModelOpt checkpoints: one calibrated input scale per linear, one
weight scale per tensor, one for all fused experts) through the Pallas GEMM and grouped GEMM.

The model is a ModelOpt checkpoint written (as tests/test_modelopt_checkpoint.py writes one) from
random HF tensors of a 2-layer config whose shapes the kernels take: hidden 128, head_dim 64,
expert and MLP width 256 (128 per shard at TP2), dense layer then MoE; layer 0's attention,
the router and the LM head stay BF16 (EXCLUDE). Its oracle is test_checkpoint.np_forward, float64.
"""

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from param_utils import flat_params
from test_checkpoint import np_forward, random_hf_tensors
from test_kernels_model import _pallas_and_xla, _rel, lowered_step
from test_modelopt_checkpoint import (
  EXCLUDE,
  _quant_config,
  modelopt_layout,
  static_act,
  write_checkpoint,
)
from test_sharded_kernels import _decode_step, reference_kernels  # noqa: F401 (fixture)

import maverick
import pallas_kernels
from maverick import config as config_lib
from maverick import kernels as kernels_lib
from maverick import model as model_lib
from maverick import moe, quant
from maverick.checkpoint import load_hf
from pallas_kernels import common, gemm, grouped_gemm

ALIGNED = dict(hidden_size=128, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=256, intermediate_size_mlp=256, num_hidden_layers=2,
               layer_types=["chunked_attention", "full_attention"], no_rope_layers=[1, 0],
               moe_layers=[1], attention_chunk_size=64)
STATIC = quant.QuantConfig(activations="static_per_tensor")


@pytest.fixture(scope="module")
def aligned(tmp_path_factory, hf_fixture_dir):
  """(checkpoint dir, HF config, dequantized HF tensors, input scales by module)."""
  cfg = dict(json.loads((hf_fixture_dir / "config.json").read_text()), **ALIGNED)
  t = random_hf_tensors(config_lib.from_hf(cfg), np.random.default_rng(0))
  calib = np.random.default_rng(1).integers(0, cfg["vocab_size"], (4, 24))
  stored, ref, input_scales = modelopt_layout(t, cfg, calib)
  # A bf16 KV cache (no kv_cache_quant_algo, no k/v scales): the KV cache's quantization is
  # another feature, and the float64 oracle here models the linears' and experts' alone.
  stored = {n: v for n, v in stored.items() if not n.endswith(("k_proj.k_scale", "v_proj.v_scale"))}
  d = write_checkpoint(tmp_path_factory.mktemp("modelopt_aligned") / "hf", cfg, stored,
                       _quant_config(EXCLUDE, kv=None))
  return d, cfg, ref, input_scales


def _load(aligned, dtype):
  m = load_hf(str(aligned[0]), dtype=dtype)
  assert (m.config.quant.activations, m.config.quant.kv_cache) == ("static_per_tensor", None)
  return m


@pytest.fixture(scope="module")
def model(aligned):
  return _load(aligned, "bfloat16")


@pytest.fixture(scope="module")
def model_f32(aligned):
  return _load(aligned, "float32")


def _per_tensor_weight(rng, shape, in_axes):
  """(K-major e4m3 weight, its per-tensor scale broadcast per output channel), as the ModelOpt
  loader stores one: amax / 448 over the whole tensor (all experts)."""
  w = rng.standard_normal(shape).astype(np.float32) * 0.1
  s = np.float32(np.abs(w).max() / quant.FP8_MAX)
  q = np.clip(w / s, -quant.FP8_MAX, quant.FP8_MAX).astype(quant.FP8)
  out_shape = [n for i, n in enumerate(shape) if i not in in_axes]
  return quant.to_kmajor(jnp.asarray(q), in_axes), jnp.full(out_shape, s, jnp.float32)


def _fp8_kernel_spy(monkeypatch) -> list[str]:
  """Records the FP8 kernel entry points the model calls with implementation="pallas"."""
  calls = []
  for module, name in ((gemm, "gemm"), (grouped_gemm, "grouped_swiglu"),
                       (grouped_gemm, "grouped_matmul")):
    def spy(x, *args, _original=getattr(module, name), _name=name, **kw):
      if x.dtype == quant.FP8 and kw.get("implementation") == "pallas":
        calls.append(_name)
      return _original(x, *args, **kw)
    monkeypatch.setattr(module, name, spy)
  return calls


# The same static quantization code on both sides and exact e4m3 products: only the f32 summation
# order differs, so the FP8 tests' bf16 output tolerance (1e-2 relative).
def test_static_fp8_linears_match_xla(monkeypatch):
  """q/k/v, o and MLP specs; input scales calibrated (max |x| / 448), and for o one that clips (a
  quarter of that: the tail saturates at +-448, as the XLA path clips it)."""
  rng = np.random.default_rng(3)
  calls = _fp8_kernel_spy(monkeypatch)
  for spec, xs, ws, in_axes, shrink in [("btd,dhk->bthk", (2, 40, 128), (128, 4, 64), (0,), 1),
                                        ("bthk,hkd->btd", (2, 40, 4, 64), (4, 64, 128), (0, 1), 4),
                                        ("...f,fd->...d", (7, 128), (128, 192), (0,), 1)]:
    x = jnp.asarray(rng.standard_normal(xs), jnp.bfloat16)
    w, s = _per_tensor_weight(rng, ws, in_axes)
    si = jnp.float32(float(jnp.abs(x.astype(jnp.float32)).max()) / quant.FP8_MAX / shrink)
    out, ref = _pallas_and_xla(lambda k: quant.einsum(spec, x, w, s, STATIC, kernels=k,
                                                      input_scale=si))
    assert _rel(out, ref) < 1e-2, spec
  assert calls == ["gemm"] * 3  # the kernel path, not XLA twice


@pytest.mark.slow
def test_static_fp8_experts_match_xla(monkeypatch):
  """Routed experts with one scale pair for all experts (ModelOpt's fused layout): the kernels
  group the rows; the XLA path groups them too at 80 tokens."""
  rng = np.random.default_rng(4)
  E, D, F, top_k, n = 8, 128, 128, 2, 80
  x = jnp.asarray(rng.standard_normal((n, D)), jnp.bfloat16)
  ws = [_per_tensor_weight(rng, sh, (1,)) for sh in ((E, D, F), (E, D, F), (E, F, D))]
  top = jnp.asarray(np.stack([rng.permutation(E)[:top_k] for _ in range(n)]), jnp.int32)
  scores = jnp.asarray(rng.uniform(0.2, 1.0, (n, top_k)), jnp.bfloat16)
  gate_up = jnp.float32(4.0 / quant.FP8_MAX)  # one scale for gate and up, as ModelOpt stores it
  statics = (gate_up, gate_up, jnp.float32(0.5 / quant.FP8_MAX))
  calls = _fp8_kernel_spy(monkeypatch)
  out, ref = _pallas_and_xla(lambda k: moe.moe_experts(
      x, top, scores, *(w for w, _ in ws), scales=tuple(s for _, s in ws), quant=STATIC,
      kernels=k, input_scales=statics))
  assert _rel(out, ref) < 1e-2 and calls == ["grouped_swiglu", "grouped_matmul"], calls


_FP8_GEMM = re.compile(r"\(tensor<\d+x\d+xf8E4M3FN>, tensor<\d+x\d+xf8E4M3FN>, tensor<\d+xf32>, "
                       r"tensor<\d+xf32>\)")
_FP8_GROUPED = re.compile(r"\(tensor<\d+(?:x\d+)?xi32>, tensor<\d+x\d+xf8E4M3FN>, "
                          r"(tensor<\d+x\d+x\d+xf8E4M3FN>, )+")


def _fp8_kernel_calls(hlo: str) -> tuple[int, int]:
  """(FP8 GEMM calls, FP8 grouped GEMM calls) among the Mosaic GPU custom calls, told apart by
  their operand types: e4m3 x [M, K] and w [N, K] with f32 row / column scales, or the group
  schedule (i32 [R, W]; decode's per-row groups, i32 [A]), e4m3 rows and [E, N, K] expert
  weights."""
  calls = [line[line.rindex(" : ("):] for line in common.mosaic_call_lines(hlo)]
  return (sum(bool(_FP8_GEMM.match(c, 3)) for c in calls),
          sum(bool(_FP8_GROUPED.match(c, 3)) for c in calls))


def _fp8_weights(model) -> tuple[int, int]:
  """(FP8 linear weights, FP8 MoE layers) of `model`, from its parameters: routed experts are the
  3-D gate/up/down directly under a layer's ffn; every other e4m3 parameter is a linear."""
  fp8 = [p for p, v in flat_params(model).items() if v.dtype == quant.FP8]
  experts = [p for p in fp8 if p[-2] == "ffn" and p[-1] in ("gate", "up", "down")
             and flat_params(model)[p].ndim == 3]
  assert len(experts) % 3 == 0, experts
  return len(fp8) - len(experts), len(experts) // 3


@pytest.mark.slow
def test_modelopt_model_runs_every_fp8_projection_and_expert_on_the_kernels(model):
  """kernels="pallas" (lowered for sm_90): one Mosaic FP8 GEMM per FP8 projection and the fused
  gate/up + down grouped GEMMs per FP8 MoE layer, prefill and decode."""
  linears, moe_layers = _fp8_weights(model)
  assert (linears, moe_layers) == (10, 1)  # layer 0: MLP; layer 1: q, k, v, o, shared; experts
  kernels_lib.set_kernels(model, None)  # auto: decided by the planner in lowering
  for shape, decode in (((2, 1), True), ((2, 80), False)):
    assert _fp8_kernel_calls(lowered_step(model, shape, decode)) == (linears, 2 * moe_layers)


@pytest.mark.slow
def test_modelopt_model_kernel_logits(model, model_f32, aligned, monkeypatch):
  """Prefill logits in GPU interpret mode against the float64 forward of the dequantized weights
  with the same static activation quantization (the checkpoint's exact model).

  float32 activations: both paths are that model up to f32 summation order (observed 2.6e-7
  each); an e4m3 rounding flip anywhere would cost >= 1e-4. Bound: 1.25 x the XLA path's error
  plus a 1e-5 floor. bfloat16 (as the record runs): a bf16 rounding difference that crosses an
  e4m3 step in the next layer's input is a whole quantization step, so two correct paths differ
  by ~12 % on this random model, and which is closer varies with the input (seed 2: kernels 0.146,
  XLA 0.111; seed 7: 0.129 and 0.168; the per-token mode shows the same spread): bound 1.5 x the
  XLA path's error plus 0.02."""
  _, cfg, ref_tensors, input_scales = aligned
  tokens = np.random.default_rng(2).integers(0, cfg["vocab_size"], (2, 40))
  want = np_forward(cfg, ref_tensors, tokens, act=static_act(input_scales))
  err = lambda a: _rel(np.asarray(a, np.float64), want)
  calls = _fp8_kernel_spy(monkeypatch)
  for m, factor, floor in ((model_f32, 1.25, 1e-5), (model, 1.5, 0.02)):
    prefill = lambda k: (kernels_lib.set_kernels(m, k),
                         model_lib.apply(*nnx.split(m), jnp.asarray(tokens)).logits)[1]
    calls.clear()
    pallas, xla = _pallas_and_xla(prefill)
    assert sorted(set(calls)) == ["gemm", "grouped_matmul", "grouped_swiglu"], calls
    assert err(pallas) <= factor * err(xla) + floor, (m.config.dtype, err(pallas), err(xla))


def _tp2(aligned, dtype):
  from maverick import sharding
  return maverick.load(str(aligned[0]), dtype=dtype, mesh=sharding.make_mesh(data=4, tensor=2),
                       layout="tp").model


@pytest.mark.slow
def test_sharded_modelopt_model_lowers_every_fp8_kernel(aligned, model_f32):
  """Loaded onto a TP2 mesh, the static scalars replicated: the decode step lowered for sm_90
  has one Mosaic FP8 GEMM per FP8 projection and the two grouped GEMMs per FP8 MoE layer, as on
  one device."""
  linears, moe_layers = _fp8_weights(model_f32)
  sharded = _tp2(aligned, "bfloat16")
  kernels_lib.set_kernels(sharded, None)  # auto: lower_for_gpu targets sm_90
  fn, args = _decode_step(sharded)
  hlo = pallas_kernels.lower_for_gpu(lambda *a: fn(*a), *args)
  assert _fp8_kernel_calls(hlo) == (linears, 2 * moe_layers)


@pytest.mark.slow
def test_sharded_modelopt_model_kernel_path(aligned, model_f32, reference_kernels):  # noqa: F811
  """The TP2 kernel path's numbers: the entry points run their XLA references (as in
  test_sharded_kernels: interpret mode cannot run under shard_map on host devices) on the local
  FP8 operands, and the logits equal the single-device static model's (float32, as
  test_modelopt_checkpoint's sharded test: in bf16 any summation-order difference can cross an
  e4m3 step; see above)."""
  sharded = _tp2(aligned, "float32")
  tokens = jnp.asarray(np.random.default_rng(5).integers(0, 512, (4, 24)), jnp.int32)
  kernels_lib.set_kernels(model_f32, "xla")
  want = np.asarray(model_lib.apply(*nnx.split(model_f32), tokens).logits)
  with pallas_kernels.interpret():
    kernels_lib.set_kernels(sharded, "pallas")
    got = np.asarray(model_lib.apply(*nnx.split(sharded), tokens).logits)
  np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)
  fp8 = [(name, shapes) for name, shapes, dtype, *_ in reference_kernels if dtype == quant.FP8]
  assert {n for n, _ in fp8} == {"gemm", "gemm_many_partials", "grouped_swiglu",
                                 "grouped_matmul"}, fp8
  # Local shapes: the experts' width split over tensor=2 (256 -> 128).
  assert {s[1] for n, s in fp8 if n == "grouped_swiglu"} == {(8, 128, 128)}, fp8
