"""Import of FP8 Hugging Face checkpoints (compressed-tensors and fbgemm layouts, spec §9).

The small checkpoints are written here from the HF fixture's float32 tensors, quantized with an
independent float64 + ml_dtypes reference; the expected forward is the float64 NumPy implementation
of the spec (test_checkpoint.np_forward) over the dequantized tensors.
"""

import json
import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from param_utils import assert_same_params, flat_params
from safetensors.numpy import load_file, save_file
from test_checkpoint import _assert_no_output, np_forward

from maverick import quant
from maverick.checkpoint import (
  CheckpointError,
  convert_hf_to_orbax,
  load_hf,
  load_orbax,
)

E4M3 = ml_dtypes.float8_e4m3fn
COMPRESSED = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                    "dynamic": False, "observer": "minmax"},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "dynamic": True, "symmetric": True}}},
    "ignore": ["re:.*lm_head", "re:.*self_attn", "re:.*router"]}
FBGEMM = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
          "modules_to_not_convert": ["lm_head", "router"]}


def _quantize_rows(w, axis, scale_dtype):
  """float64 reference: e4m3 with one scale per slice along `axis` reduced (max|w| / 448)."""
  w64 = w.astype(np.float64)
  s = np.abs(w64).max(axis=axis, keepdims=True) / 448
  s = np.where(s > 0, s, 1.0).astype(scale_dtype)
  q = np.clip(w64 / s.astype(np.float64), -448, 448).astype(E4M3)
  # C order: safetensors writes the raw buffer (a transposed view would be stored transposed).
  return np.ascontiguousarray(q), np.ascontiguousarray(s)


def _deq(q, s):
  return q.astype(np.float64) * s.astype(np.float64)


@pytest.fixture(scope="module")
def fixture_tensors(hf_fixture_dir):
  return load_file(str(hf_fixture_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def hf_config(hf_fixture_dir):
  return json.loads((hf_fixture_dir / "config.json").read_text())


def _moe_layers(t):
  return sorted({int(n.split(".")[2]) for n in t if n.endswith("experts.gate_up_proj")})


def compressed_tensors_layout(t: dict) -> tuple[dict, dict]:
  """The official Maverick FP8 layout: routed experts unfused, FP8 [out, in] + bf16 scale
  [out, 1]; everything else unchanged. Returns (stored tensors, dequantized HF-layout tensors)."""
  out, ref = dict(t), dict(t)
  for i in _moe_layers(t):
    p = f"model.layers.{i}.feed_forward.experts."
    gu, dn = out.pop(p + "gate_up_proj"), out.pop(p + "down_proj")
    F = dn.shape[1]
    gus, dns = [], []
    for e in range(gu.shape[0]):
      deq = {}
      for proj, w in (("gate", gu[e][:, :F].T), ("up", gu[e][:, F:].T), ("down", dn[e].T)):
        q, s = _quantize_rows(w, 1, ml_dtypes.bfloat16)
        out[f"{p}{e}.{proj}_proj.weight"] = q
        out[f"{p}{e}.{proj}_proj.weight_scale"] = s
        deq[proj] = _deq(q, s)
      gus.append(np.concatenate([deq["gate"].T, deq["up"].T], -1))
      dns.append(deq["down"].T)
    ref[p + "gate_up_proj"], ref[p + "down_proj"] = np.stack(gus), np.stack(dns)
  return out, ref


def fbgemm_layout(t: dict) -> tuple[dict, dict]:
  """fbgemm: every linear but router/lm_head FP8 with f32 [out, 1] scales; experts stay fused
  ([E, D, 2F] with [E, 1, 2F] scales, [E, F, D] with [E, D, 1])."""
  out, ref = dict(t), dict(t)
  for n, w in t.items():
    linear = n.endswith("proj.weight") and ("self_attn" in n or "feed_forward" in n)
    if linear:
      q, s = _quantize_rows(w, 1, np.float32)
      out[n], out[n[:-len("weight")] + "weight_scale"] = q, s
      ref[n] = _deq(q, s)
    elif n.endswith("experts.gate_up_proj"):
      q, s = _quantize_rows(w, 1, np.float32)  # per output column: reduce over D
      out[n], out[n + "_scale"], ref[n] = q, s, _deq(q, s)
    elif n.endswith("experts.down_proj"):
      q, s = _quantize_rows(w, 1, np.float32)  # [E, 1, D] -> stored as [E, D, 1]
      out[n], out[n + "_scale"], ref[n] = q, np.ascontiguousarray(s.transpose(0, 2, 1)), _deq(q, s)
  return out, ref


def _write(d, config, qcfg, tensors):
  d = pathlib.Path(d)
  d.mkdir(parents=True, exist_ok=True)
  cfg = dict(config)
  if qcfg is not None:
    cfg["quantization_config"] = qcfg
  (d / "config.json").write_text(json.dumps(cfg))
  save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
  return d


@pytest.fixture(scope="module")
def compressed(tmp_path_factory, fixture_tensors, hf_config):
  stored, ref = compressed_tensors_layout(fixture_tensors)
  d = _write(tmp_path_factory.mktemp("ct") / "hf", hf_config, COMPRESSED, stored)
  return d, stored, ref


@pytest.fixture(scope="module")
def compressed_model(compressed):
  return load_hf(str(compressed[0]), dtype="float32")


@pytest.mark.slow
def test_compressed_tensors_import(compressed, compressed_model, hf_config, hf_fixture):
  _, stored, ref = compressed
  model = compressed_model
  qc = model.config.quant
  assert qc.activations == "dynamic_per_token" and qc.activation_scale_ub is None
  assert set(qc.skip) == {"attn", "embed", "lm_head", "mlp", "router", "shared"}
  assert qc.quantizes("layers.3.experts.down") and not qc.quantizes("layers.3.shared.down")
  params = flat_params(model)
  gate = params[("layers", 3, "ffn", "gate")]
  assert gate.dtype == jnp.float8_e4m3fn
  p = "model.layers.3.feed_forward.experts."
  # FP8 experts are kept K-major, [E, out, in]: the HF tensors stacked bit for bit
  want = np.stack([stored[f"{p}{e}.gate_proj.weight"] for e in range(gate.shape[0])])
  np.testing.assert_array_equal(gate.view(np.uint8), want.view(np.uint8))
  np.testing.assert_array_equal(params[("layers", 3, "ffn", "down_scale")][5],
                                stored[f"{p}5.down_proj.weight_scale"][:, 0].astype(np.float32))
  assert params[("layers", 3, "attn", "q")].dtype == np.float32
  # The dequantized weights reproduce the float64 reference forward over dequantized tensors.
  inputs = hf_fixture["inputs"]
  want = np_forward(hf_config, ref, inputs)
  deq = quant.dequantize_model(model)
  np.testing.assert_allclose(np.asarray(deq(jnp.asarray(inputs)).logits), want, atol=1e-4)
  # With per-token FP8 activations (the checkpoint's own mode): close, judged by agreement.
  got = np.asarray(model(jnp.asarray(inputs)).logits)
  assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9
  assert np.abs(got - want).mean() <= 0.03 * np.abs(want).mean()


@pytest.mark.slow
def test_fbgemm_import(tmp_path, fixture_tensors, hf_config, hf_fixture):
  stored, ref = fbgemm_layout(fixture_tensors)
  d = _write(tmp_path / "hf", hf_config, FBGEMM, stored)
  model = load_hf(str(d), dtype="float32")
  qc = model.config.quant
  assert set(qc.skip) == {"embed", "lm_head", "router"} and qc.activation_scale_ub == 1200.0
  params = flat_params(model)
  assert params[("layers", 0, "attn", "o")].dtype == jnp.float8_e4m3fn
  assert params[("layers", 0, "attn", "q_scale")].shape == (4, 32)
  assert params[("layers", 1, "ffn", "up_scale")].shape == (8, 48)
  want = np_forward(hf_config, ref, hf_fixture["inputs"])
  deq = quant.dequantize_model(model)
  np.testing.assert_allclose(np.asarray(deq(jnp.asarray(hf_fixture["inputs"])).logits), want,
                             atol=1e-4)


def test_convert_fp8_checkpoint_records_quant(compressed, compressed_model, tmp_path):
  out = convert_hf_to_orbax(str(compressed[0]), str(tmp_path / "conv"), dtype="float32",
                            progress=False)
  meta = json.loads((pathlib.Path(out) / "maverick.json").read_text())
  assert meta["config"]["quant"] == compressed_model.config.quant.to_dict()
  assert_same_params(load_orbax(out), compressed_model)


def test_bf16_kv_cache_is_a_compressed_tensors_checkpoints_own(compressed, compressed_model):
  """A compressed-tensors FP8 checkpoint's KV cache is unquantized: kv_cache="bf16" (the name
  maverick.load and --kv_cache give it) loads the same model; the FP8 formats are ModelOpt's."""
  model = load_hf(str(compressed[0]), dtype="float32", kv_cache="bf16")
  assert model.config.quant == compressed_model.config.quant
  assert model.config.quant.kv_cache is None
  assert_same_params(model, compressed_model)
  with pytest.raises(CheckpointError, match="applies to ModelOpt FP8 checkpoints"):
    load_hf(str(compressed[0]), kv_cache="fp8_static")


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------
E = "model.layers.3.feed_forward.experts."


def _missing_scale(t, c):
  del t[E + "5.up_proj.weight_scale"]


def _scale_shape(t, c):
  t[E + "2.down_proj.weight_scale"] = t[E + "2.down_proj.weight_scale"][:, 0].copy()


def _fp8_linear_no_scale(t, c):
  n = "model.layers.0.self_attn.q_proj.weight"
  t[n] = t[n].astype(E4M3)


def _orphan_scale(t, c):
  t["model.layers.0.self_attn.q_proj.weight_scale"] = np.ones((128, 1), np.float32)


def _nan_fp8(t, c):
  w = t[E + "1.gate_proj.weight"].copy()
  w.view(np.uint8)[3, 4] = 0x7F
  t[E + "1.gate_proj.weight"] = w


def _inf_scale(t, c):
  s = t[E + "0.down_proj.weight_scale"].astype(np.float32)
  s[7, 0] = np.inf
  t[E + "0.down_proj.weight_scale"] = s


def _nan_bf16(t, c):
  w = t["model.layers.2.self_attn.k_proj.weight"].copy()
  w[1, 1] = np.nan
  t["model.layers.2.self_attn.k_proj.weight"] = w


def _norm_fp8(t, c):
  t["model.norm.weight"] = t["model.norm.weight"].astype(E4M3)
  t["model.norm.weight_scale"] = np.ones((64, 1), np.float32)


def _tensor_strategy(t, c):
  c["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"


def _expert_missing(t, c):
  del t[E + "7.down_proj.weight"], t[E + "7.down_proj.weight_scale"]


@pytest.mark.slow
@pytest.mark.parametrize("mutate,words", [
    (_missing_scale, [E + "5.up_proj.weight", "scale", "missing"]),
    (_scale_shape, [E + "2.down_proj.weight_scale", "[64]", "[64, 1]"]),
    (_fp8_linear_no_scale, ["model.layers.0.self_attn.q_proj.weight", "missing"]),
    (_orphan_scale, ["model.layers.0.self_attn.q_proj.weight", "F32"]),
    (_nan_fp8, [E + "1.gate_proj.weight", "NaN"]),
    (_inf_scale, [E + "0.down_proj.weight_scale", "NaN/inf"]),
    (_nan_bf16, ["model.layers.2.self_attn.k_proj.weight", "NaN"]),
    (_norm_fp8, ["model.norm.weight", "unquantized"]),
    (_tensor_strategy, ["strategy 'tensor'", "channel"]),
    (_expert_missing, [E + "7.down_proj.weight", "missing"]),
], ids=["scale_missing", "scale_shape", "fp8_no_scale", "orphan_scale", "nan_fp8", "inf_scale",
        "nan_bf16", "norm_fp8", "tensor_strategy", "expert_missing"])
def test_bad_fp8_checkpoints(tmp_path, compressed, hf_config, mutate, words):
  t = dict(compressed[1])
  c = json.loads(json.dumps(dict(hf_config, quantization_config=COMPRESSED)))
  mutate(t, c)
  d = _write(tmp_path / "hf", c, None, t)
  out = tmp_path / "out"
  with pytest.raises(CheckpointError) as e:
    convert_hf_to_orbax(str(d), str(out), progress=False)
  for w in words:
    assert w in str(e.value), (w, str(e.value))
  _assert_no_output(out)
  with pytest.raises(CheckpointError):
    load_hf(str(d))
