"""Import of NVIDIA ModelOpt FP8 checkpoints (maverick/checkpoint/hf_modelopt.py).

The checkpoint is written here, into tmp_path, from the HF fixture's float32 tensors in the layout
ModelOpt's exporter produces: per-tensor e4m3 weights with scalar `weight_scale`, static scalar
`input_scale` calibrated (max |x| / 448) on a fixed-seed token batch, fused experts with one
`gate_up_proj_*` / `down_proj_*` scale pair, `k_scale` / `v_scale`, an `exclude_modules` list, and
`hf_quant_config.json` (+ config.json `quantization_config`). The quantization is a float64 NumPy
reference (ml_dtypes e4m3); the oracle is test_checkpoint.np_forward over the dequantized tensors
with the same activation quantization applied to every FP8 linear's input.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from param_utils import assert_same_params, flat_params
from safetensors.numpy import load_file, save_file
from test_checkpoint import _assert_no_output, _cli, _one_line_error, np_forward

import maverick
from maverick import generation as gen
from maverick import model as model_lib
from maverick import quant
from maverick.checkpoint import CheckpointError, convert_hf_to_orbax, load_hf, load_orbax

E4M3 = ml_dtypes.float8_e4m3fn
# What stays BF16: the router and lm_head (as in NVIDIA's exports), plus layer 0's attention to
# exercise a wildcard over part of a kind.
EXCLUDE = ["lm_head", "*router*", "model.layers.0.self_attn*", "vision_model*",
           "multi_modal_projector*"]
MM_EXCLUDE = ["language_model.lm_head", "language_model.model.layers.*.feed_forward.router",
              "language_model.model.layers.0.self_attn*", "vision_model*", "multi_modal_projector*"]


def _fp8_modules(t: dict) -> list[str]:
  """HF modules ModelOpt quantizes here: every decoder linear and the fused experts, minus
  EXCLUDE (router, layer 0 attention)."""
  mods = []
  for n in t:
    if (not n.startswith("model.layers.") or "router" in n
        or n.startswith("model.layers.0.self_attn")):
      continue
    if n.endswith("proj.weight"):
      mods.append(n[:-len(".weight")])
    elif n.endswith(("experts.gate_up_proj", "experts.down_proj")):
      mods.append(n)
  return sorted(mods)


def _tensor(mod: str) -> str:
  fused = "experts" in mod and mod.endswith(("gate_up_proj", "down_proj"))
  return mod if fused else mod + ".weight"


def _scale_names(mod: str) -> tuple[str, str]:
  t = _tensor(mod)
  if t.endswith(".weight"):
    return mod + ".weight_scale", mod + ".input_scale"
  return t + "_weight_scale", t + "_input_scale"


def fake_quant(x, s):
  """Reference e4m3 quantization, float64: e4m3(clip(x / s)) * s (s a scalar or per row)."""
  s = np.float64(s)
  return np.clip(x / s, -448, 448).astype(E4M3).astype(np.float64) * s


def row_quant(x):
  """Reference dynamic per-row quantization (maverick.quant.quantize_rows), float64."""
  return fake_quant(x, np.maximum(np.abs(x).max(-1, keepdims=True), 1 / 512) / 448)


def static_act(input_scales: dict):
  """Reference static activation quantization with each module's input scale."""
  return lambda x, mod: fake_quant(x, input_scales[mod]) if mod in input_scales else x


def dynamic_act(mods):
  """Reference dynamic per-token activation quantization of the modules' inputs."""
  mods = set(mods)
  return lambda x, mod: row_quant(x) if mod in mods else x


def modelopt_layout(t: dict, cfg: dict, calib_ids: np.ndarray):
  """(stored tensors, dequantized HF tensors, input scales by module)."""
  amax: dict[str, float] = {}

  def record(x, mod):
    amax[mod] = max(amax.get(mod, 0.0), float(np.abs(x).max(initial=0.0)))
    return x
  np_forward(cfg, t, calib_ids, act=record)  # calibration on the BF16 weights, as ModelOpt does
  out, ref, input_scales = dict(t), dict(t), {}
  for mod in _fp8_modules(t):
    name = _tensor(mod)
    w = t[name].astype(np.float64)
    s = np.float32(np.abs(w).max() / 448)  # one scalar for the whole tensor (all experts)
    q = np.ascontiguousarray(np.clip(w / np.float64(s), -448, 448).astype(E4M3))
    ws, ins = _scale_names(mod)
    si = np.float32(amax[mod] / 448)
    out[name], out[ws], out[ins] = q, np.array(s, np.float32), np.array(si, np.float32)
    ref[name] = q.astype(np.float64) * np.float64(s)
    input_scales[mod] = si
  for i in range(cfg["num_hidden_layers"]):  # amax / 448 clamped to >= 1 by the exporter
    p = f"model.layers.{i}.self_attn."
    out[p + "k_proj.k_scale"] = np.array(1.0, np.float32)
    out[p + "v_proj.v_scale"] = np.array(1.0, np.float32)
  return out, ref, input_scales


def _quant_config(exclude, algo="FP8", kv="FP8"):
  return {"producer": {"name": "modelopt", "version": "0.29.0"},
          "quantization": {"quant_algo": algo, "kv_cache_quant_algo": kv,
                           "exclude_modules": exclude}}


def _config_json_form(exclude, algo="FP8"):
  """What the exporter also puts in config.json (convert_hf_quant_config_format)."""
  return {"config_groups": {"group_0": {
              "input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
              "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
              "targets": ["Linear"]}},
          "ignore": exclude, "quant_algo": algo,
          "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
          "producer": {"name": "modelopt", "version": "0.29.0"}, "quant_method": "modelopt"}


def write_checkpoint(d, config: dict, tensors: dict, hf_quant: dict | None,
                     config_qc: dict | None = None) -> pathlib.Path:
  d = pathlib.Path(d)
  d.mkdir(parents=True, exist_ok=True)
  cfg = dict(config)
  if config_qc is not None:
    cfg["quantization_config"] = config_qc
  (d / "config.json").write_text(json.dumps(cfg))
  if hf_quant is not None:
    (d / "hf_quant_config.json").write_text(json.dumps(hf_quant))
  save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
  return d


@pytest.fixture(scope="module")
def hf_config(hf_fixture_dir):
  return json.loads((hf_fixture_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def layout(hf_fixture_dir, hf_config):
  t = load_file(str(hf_fixture_dir / "model.safetensors"))
  calib = np.random.default_rng(0).integers(0, hf_config["vocab_size"], (4, 24))
  return modelopt_layout(t, hf_config, calib)


def _write_both_configs(tmp_path_factory, name, hf_config, tensors):
  """The checkpoint with hf_quant_config.json and config.json's quantization_config."""
  return write_checkpoint(tmp_path_factory.mktemp(name) / "hf", hf_config, tensors,
                          _quant_config(EXCLUDE), _config_json_form(EXCLUDE))


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory, hf_config, layout):
  return _write_both_configs(tmp_path_factory, "modelopt", hf_config, layout[0])


@pytest.fixture(scope="module")
def model(ckpt_dir):
  """The dynamic per-token FP8 KV cache (kv_cache="fp8"): the checkpoint's k/v scales unused."""
  return load_hf(str(ckpt_dir), dtype="float32", kv_cache="fp8")


@pytest.fixture(scope="module")
def static_kv(layout, hf_config):
  """(stored tensors with calibrated k_scale / v_scale, scales {"k"/"v": [per layer]}). The
  scales are max |K| (|V|) / 448 of each layer on a calibration batch, NOT clamped to >= 1 as the
  exporter does, so that they differ per layer and matter on this small model."""
  stored, ref, input_scales = layout
  amax = {}

  def record(x, kind, i):
    amax[kind, i] = max(amax.get((kind, i), 0.0), float(np.abs(x).max()))
    return x
  calib = np.random.default_rng(1).integers(0, hf_config["vocab_size"], (4, 24))
  np_forward(hf_config, ref, calib, act=static_act(input_scales), kv=record)
  t, scales = dict(stored), {"k": [], "v": []}
  for i in range(hf_config["num_hidden_layers"]):
    for kind in "kv":
      s = np.float32(amax[kind, i] / 448)
      t[f"model.layers.{i}.self_attn.{kind}_proj.{kind}_scale"] = np.array(s, np.float32)
      scales[kind].append(s)
  return t, scales


@pytest.fixture(scope="module")
def static_kv_dir(tmp_path_factory, hf_config, static_kv):
  return _write_both_configs(tmp_path_factory, "modelopt_kv", hf_config, static_kv[0])


@pytest.fixture(scope="module")
def static_kv_model(static_kv_dir):
  return load_hf(str(static_kv_dir), dtype="float32")  # the default: static KV scales


def _agreement(got, want):
  rel = np.linalg.norm(got - want) / np.linalg.norm(want)
  top1 = np.mean(got.argmax(-1) == want.argmax(-1))
  return rel, top1


@pytest.mark.slow
def test_import_static_activations(model, layout, hf_config, hf_fixture):
  stored, ref, input_scales = layout
  qc = model.config.quant
  assert (qc.weights, qc.activations, qc.kv_cache) == ("fp8", "static_per_tensor", "fp8")
  assert {"embed", "lm_head", "router"} <= set(qc.skip)
  assert qc.quantizes("layers.1.attn.q") and not qc.quantizes("layers.0.attn.q")
  assert qc.quantizes("layers.3.experts.down") and qc.quantizes("layers.2.mlp.gate")
  p = flat_params(model)
  # Fused experts [E, D, 2F], gate first: ours K-major [E, F, D], bit for bit.
  gu = stored["model.layers.3.feed_forward.experts.gate_up_proj"]
  F = hf_config["intermediate_size"]
  np.testing.assert_array_equal(p[("layers", 3, "ffn", "up")].view(np.uint8),
                                gu[..., F:].transpose(0, 2, 1).view(np.uint8))
  s = stored["model.layers.3.feed_forward.experts.gate_up_proj_weight_scale"]
  np.testing.assert_array_equal(p[("layers", 3, "ffn", "gate_scale")], np.full((8, F), s))
  assert p[("layers", 3, "ffn", "gate_input_scale")] == p[("layers", 3, "ffn", "up_input_scale")] \
      == stored["model.layers.3.feed_forward.experts.gate_up_proj_input_scale"]
  assert p[("layers", 2, "attn", "o_input_scale")].shape == ()
  assert p[("layers", 0, "attn", "q")].dtype == np.float32  # excluded: BF16 (here float32)
  assert ("layers", 0, "attn", "q_input_scale") not in p
  assert p[("layers", 1, "ffn", "router")].dtype == np.float32
  inputs = hf_fixture["inputs"]
  # The weights are exact: the dequantized model is the float64 forward of the dequantized tensors.
  deq = quant.dequantize_model(model)
  np.testing.assert_allclose(np.asarray(deq(jnp.asarray(inputs)).logits),
                             np_forward(hf_config, ref, inputs), atol=1e-4)
  # Static activations: the reference applies the same e4m3(clip(x / input_scale)).
  want = np_forward(hf_config, ref, inputs, act=static_act(input_scales))
  got = np.asarray(model(jnp.asarray(inputs)).logits)
  rel, top1 = _agreement(got, want)
  assert rel < 1e-3 and top1 >= 0.98, (rel, top1)  # observed 2e-6 and 1.0
  # Few tokens (6 assignments <= 8 experts): the gathered expert path, as in decoding.
  short = inputs[:, :3]
  want = np_forward(hf_config, ref, short, act=static_act(input_scales))
  rel, _ = _agreement(np.asarray(model(jnp.asarray(short)).logits), want)
  assert rel < 1e-3, rel


@pytest.mark.slow
@pytest.mark.parametrize("layout_name,mesh_kw", [("tp", dict(data=4, tensor=2)),
                                                  ("ep", dict(expert=4, tensor=2))])
def test_static_activations_run_sharded(ckpt_dir, model, hf_fixture, layout_name, mesh_kw):
  """A direct load of the ModelOpt directory onto a mesh keeps the static activation scales (as
  NVIDIA's reference runs them) through the sharded attention and MoE: logits equal the
  single-device static model's (one global scalar per input, so every shard quantizes exactly as
  one device does; only the f32 sum order differs), prompt and decode-sized inputs."""
  from maverick import sharding
  loaded = maverick.load(str(ckpt_dir), dtype="float32", mesh=sharding.make_mesh(**mesh_kw),
                         layout=layout_name, kv_cache="fp8")
  assert loaded.model.config.quant.activations == "static_per_tensor"
  assert sharding.plan_of(loaded.model) is not None
  inputs = hf_fixture["inputs"]
  split = nnx.split(loaded.model)  # jitted: op-by-op dispatch on a mesh of 8 is minutes on CPU
  for x in (inputs, inputs[:, :3]):  # grouped and gathered expert paths
    got = np.asarray(model_lib.apply(*split, jnp.asarray(x)).logits)
    want = np.asarray(model(jnp.asarray(x)).logits)
    np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)


@pytest.mark.slow
def test_static_kv_scales_load_sharded(static_kv_dir, static_kv_model, hf_fixture):
  """The static KV scales go onto a mesh as replicated scalars with the checkpoint's values, and
  the sharded model computes the single-device one's logits (up to e4m3 rounding flips of f32
  sum-order noise, which the static scales make visible: top-1 agreement)."""
  from maverick import sharding
  loaded = maverick.load(str(static_kv_dir), dtype="float32",
                         mesh=sharding.make_mesh(data=4, tensor=2)).model
  assert loaded.config.quant.kv_cache == "fp8_static"
  for got, want in ((loaded.layers[i].attn, static_kv_model.layers[i].attn) for i in (0, 3)):
    for name in model_lib.KV_CACHE_SCALES:
      x = getattr(got, name)[...]
      assert x.shape == () and x.sharding.is_fully_replicated
      assert float(x) == float(getattr(want, name)[...])
  x = jnp.asarray(hf_fixture["inputs"])
  sharded = np.asarray(model_lib.apply(*nnx.split(loaded), x).logits)
  _, top1 = _agreement(sharded, np.asarray(static_kv_model(x).logits))
  assert top1 >= 0.95, top1


@pytest.mark.slow
def test_import_dynamic_activations(ckpt_dir, layout, hf_config, hf_fixture):
  _, ref, input_scales = layout
  model = load_hf(str(ckpt_dir), dtype="float32", activations="dynamic_per_token",
                  kv_cache="fp8")
  assert model.config.quant.activations == "dynamic_per_token"
  assert not any(k[-1].endswith("input_scale") for k in flat_params(model))
  inputs = hf_fixture["inputs"]
  want = np_forward(hf_config, ref, inputs, act=dynamic_act(input_scales))
  got = np.asarray(model(jnp.asarray(inputs)).logits)
  # One e4m3 rounding flip (f32 vs f64 row scale) at one position of this random model reaches
  # every later one of its row: jax 0.12.0.1 (EPYC) row errors 3.8e-3 / 2e-7, top-1 0.99; jax
  # 0.12.1 (same host) 2e-7 / 2.3e-2, top-1 0.96. So: one row exact, and top-1 overall with room
  # for the flipped row (0.9: at most 10 of 106 positions).
  row_rel = np.linalg.norm(got - want, axis=(1, 2)) / np.linalg.norm(want, axis=(1, 2))
  assert row_rel.min() < 1e-5, row_rel
  assert _agreement(got, want)[1] >= 0.9, _agreement(got, want)
  # ... while the static reference is 7e-2 away: the mode is really the one used.
  static = np_forward(hf_config, ref, inputs, act=static_act(input_scales))
  assert _agreement(static, want)[0] > 3e-2


@pytest.mark.slow
def test_static_kv_cache_matches_float64_reference(static_kv_model, static_kv, layout, hf_config,
                                                   hf_fixture):
  """kv_cache_quant_algo FP8 loads as the static FP8 KV cache by default: each layer's k_scale /
  v_scale become replicated scalars in the model state, and attention reads K and V as
  e4m3(clip(x / scale)) * scale, which the float64 reference applies alike."""
  _, ref, input_scales = layout
  scales = static_kv[1]
  qc = static_kv_model.config.quant
  assert (qc.activations, qc.kv_cache) == ("static_per_tensor", "fp8_static")
  p = flat_params(static_kv_model)
  for i in range(hf_config["num_hidden_layers"]):
    for kind in "kv":
      got = p[("layers", i, "attn", f"{kind}_cache_scale")]
      assert got.shape == () and got == scales[kind][i], (i, kind, got)
  inputs = hf_fixture["inputs"]
  act = static_act(input_scales)
  want = np_forward(hf_config, ref, inputs, act=act,
                    kv=lambda x, kind, i: fake_quant(x, scales[kind][i]))
  got = np.asarray(static_kv_model(jnp.asarray(inputs)).logits)
  # Static scales put every K/V element on a fixed e4m3 grid, so f32 sum-order noise can land one
  # on the other side of a rounding midpoint, and every later query of that row reads it. On an
  # AVX-512 Xeon row 0 flips at position 2 (then ~3e-2 per position, top-1 0.97 overall) while
  # row 1 stays at 2e-7; an EPYC kept both rows exact. So: one row exact, top-1 overall.
  row_rel = np.linalg.norm(got - want, axis=(1, 2)) / np.linalg.norm(want, axis=(1, 2))
  assert row_rel.min() < 1e-5, row_rel
  assert _agreement(got, want)[1] >= 0.95, _agreement(got, want)
  # The scales are really used: unquantized or per-token-quantized K/V are much further away
  # (observed 7.8e-2 and 8.7e-2).
  for other in (np_forward(hf_config, ref, inputs, act=act),
                np_forward(hf_config, ref, inputs, act=act, kv=lambda x, *_: row_quant(x))):
    assert _agreement(other, want)[0] > 3e-2, _agreement(other, want)


def test_static_kv_cache_has_no_per_token_scales(static_kv_model):
  from maverick import kv_cache as kvc
  cache = kvc.KVCache.init(static_kv_model.config, 2, 16)
  assert cache.k_scale is None and cache.v_scale is None and not cache.quantized
  assert {x.dtype for x in cache.k + cache.v} == {jnp.dtype(jnp.float8_e4m3fn)}
  # K and V per layer, and the lengths: nothing else
  assert len(jax.tree.leaves(cache)) == 2 * static_kv_model.config.num_hidden_layers + 1


@pytest.mark.slow
def test_static_kv_scales_survive_convert_and_load(tmp_path, static_kv_dir, static_kv_model,
                                                   hf_fixture):
  out = convert_hf_to_orbax(str(static_kv_dir), str(tmp_path / "conv"), dtype="float32",
                            progress=False)
  loaded = load_orbax(out)
  assert loaded.config.quant.kv_cache == "fp8_static"
  assert_same_params(loaded, static_kv_model)
  inputs = jnp.asarray(hf_fixture["inputs"][:, :5])
  np.testing.assert_array_equal(np.asarray(loaded(inputs).logits),
                                np.asarray(static_kv_model(inputs).logits))


@pytest.fixture(scope="module")
def bf16_kv_model(static_kv_dir):
  """kv_cache="bf16" on the checkpoint with calibrated k/v scales (vLLM's --kv-cache-dtype
  bfloat16): an unquantized cache, the scales checked and dropped."""
  return load_hf(str(static_kv_dir), dtype="float32", kv_cache="bf16")


def test_bf16_kv_cache_drops_the_checkpoint_scales(bf16_kv_model, static_kv_dir, static_kv, layout,
                                                   hf_config, hf_fixture):
  """The weights and activation scales stay FP8 and static; K/V are not quantized: no scale
  params, a cache of the model dtype (float32 as loaded here, bfloat16 when loaded so) with no
  scale arrays, and logits equal to the float64 reference with unquantized K/V."""
  from maverick import kv_cache as kvc
  qc = bf16_kv_model.config.quant
  assert (qc.weights, qc.activations, qc.kv_cache) == ("fp8", "static_per_tensor", None)
  assert not any(k[-1] in model_lib.KV_CACHE_SCALES for k in flat_params(bf16_kv_model))
  L = hf_config["num_hidden_layers"]
  for dtype in ("float32", "bfloat16"):
    model = bf16_kv_model if dtype == "float32" else load_hf(str(static_kv_dir), dtype=dtype,
                                                             kv_cache="bf16")
    cache = kvc.KVCache.init(model.config, 2, 16)
    assert cache.k_scale is None and cache.v_scale is None
    assert {x.dtype for x in cache.k + cache.v} == {jnp.dtype(dtype)}
    assert len(jax.tree.leaves(cache)) == 2 * L + 1  # K and V per layer, and the lengths
  _, ref, input_scales = layout
  inputs = hf_fixture["inputs"]
  act = static_act(input_scales)
  want = np_forward(hf_config, ref, inputs, act=act)
  got = np.asarray(bf16_kv_model(jnp.asarray(inputs)).logits)
  rel, top1 = _agreement(got, want)
  assert rel < 1e-3 and top1 >= 0.98, (rel, top1)  # observed 2e-7 and 1.0
  scales = static_kv[1]
  static = np_forward(hf_config, ref, inputs, act=act,
                      kv=lambda x, kind, i: fake_quant(x, scales[kind][i]))
  assert _agreement(got, static)[0] > 3e-2, _agreement(got, static)  # observed 7.7e-2
  # HF's logits (unquantized weights and K/V): with the FP8 weights and activations left as the
  # only error, nearer than the static FP8 KV cache (observed 9.1e-2 vs 1.0e-1).
  hf_logits = hf_fixture["logits"]
  assert _agreement(got, hf_logits)[0] < _agreement(static, hf_logits)[0]


@pytest.mark.slow
def test_bf16_kv_cache_generates_the_reference_tokens(bf16_kv_model, layout, hf_config,
                                                      hf_fixture):
  """The jitted generate loop over the unquantized cache: greedy tokens are the float64
  reference's (unquantized K/V, static activations), recomputed over the whole sequence."""
  _, ref, input_scales = layout
  prompt = [int(x) for x in hf_fixture["inputs"][0, :8]]
  tokens = gen.generate(bf16_kv_model, [prompt], max_new_tokens=6, stop_tokens=[]).tokens[0]
  seq = list(prompt)
  for _ in range(6):
    logits = np_forward(hf_config, ref, np.array([seq]), act=static_act(input_scales))
    seq.append(int(np.argmax(logits[0, -1])))
  assert list(tokens) == seq[len(prompt):]


@pytest.mark.slow
def test_bf16_kv_cache_convert_cli_and_load(tmp_path, static_kv_dir, bf16_kv_model):
  """scripts/convert_hf.py --kv_cache=bf16 records the unquantized cache (no k/v scales stored);
  loading it with kv_cache="bf16" is what it is already, while a checkpoint converted with the
  static FP8 cache refuses "bf16" with the way out."""
  out = tmp_path / "bf16kv"
  r = _cli(f"--hf_dir={static_kv_dir}", f"--out_dir={out}", "--dtype=float32", "--kv_cache=bf16")
  assert r.returncode == 0, r.stderr
  meta = json.loads((out / "maverick.json").read_text())
  assert meta["config"]["quant"]["kv_cache"] is None
  loaded = maverick.load(str(out), kv_cache="bf16").model
  assert_same_params(loaded, bf16_kv_model)
  static = convert_hf_to_orbax(str(static_kv_dir), str(tmp_path / "static"), dtype="float32",
                               progress=False)
  with pytest.raises(CheckpointError, match="with kv_cache 'fp8_static'.*--kv_cache"):
    maverick.load(static, kv_cache="bf16")


def test_bf16_kv_cache_is_other_checkpoints_own(hf_fixture_dir, fixture_model):
  """A BF16 checkpoint (and the embedded and random models) takes kv_cache="bf16" as what its
  cache is; the FP8 formats stay ModelOpt-only, and an unknown name lists the choices."""
  model = load_hf(str(hf_fixture_dir), dtype="float32", kv_cache="bf16")
  assert model.config.quant is None
  assert_same_params(model, fixture_model)
  assert quant.QuantConfig(kv_cache="bf16") == quant.QuantConfig(kv_cache=None)
  for source in ("tiny", "random:tiny"):
    assert maverick.load(source, kv_cache="bf16").model.config.quant is None
  with pytest.raises(CheckpointError, match="not one"):
    load_hf(str(hf_fixture_dir), kv_cache="fp8")
  for source in (str(hf_fixture_dir), "random:tiny"):
    with pytest.raises(CheckpointError,
                       match=r"kv_cache='auto': use one of \('bf16', 'fp8', 'fp8_static'\)"):
      maverick.load(source, kv_cache="auto")
  with pytest.raises(CheckpointError, match="contradicts quant's kv_cache 'fp8'"):
    maverick.load("random:tiny", kv_cache="bf16", quant=quant.QuantConfig(kv_cache="fp8"))


@pytest.mark.slow
def test_generate_with_imported_model(static_kv_model, hf_fixture):
  """The jitted generate loop over the static FP8 KV cache: greedy tokens equal recomputing the
  whole sequence at each step."""
  prompt = [int(x) for x in hf_fixture["inputs"][0, :8]]
  tokens = gen.generate(static_kv_model, [prompt], max_new_tokens=4, stop_tokens=[]).tokens[0]
  seq = list(prompt)
  for _ in range(4):
    seq.append(int(np.argmax(np.asarray(static_kv_model(jnp.asarray([seq])).logits)[0, -1])))
  assert list(tokens) == seq[len(prompt):]


@pytest.mark.slow
def test_spec_generate_modelopt_target_nvidia_head_is_lossless(static_kv_model, tmp_path):
  """The record pair in miniature: the ModelOpt FP8 target (static activation scales, static FP8
  KV cache: the defaults) imported from NVIDIA's layout + an EAGLE-3 head in NVIDIA's layout (full
  vocabulary, no d2t, no embed_tokens, bfloat16 as shipped): speculative greedy output == plain
  greedy output (verification and rollback over the static FP8 cache; the dynamic one is covered
  by tests/test_spec_lossless.py and tests/test_tree.py).
  One case only: a speculative program takes ~1 min to compile on the CI machine."""
  import spec_decode
  from nvidia_eagle3_fixture import write_head
  from spec_decode import speculative as spec
  write_head(tmp_path / "head", seed=3, prefix="midlayer.")
  model = static_kv_model
  draft = spec_decode.load_draft(str(tmp_path / "head"), model)
  assert draft.lm_head.get_value().dtype == jnp.bfloat16
  rng = np.random.default_rng(5)
  prompts = [rng.integers(0, 512, n).tolist() for n in (3, 11, 6)]
  kw = dict(max_new_tokens=14, stop_tokens=[])
  got = spec.generate(model, draft, prompts, k=3, **kw)
  assert got.tokens == gen.generate(model, prompts, **kw).tokens
  assert all(len(t) == 14 for t in got.tokens)


@pytest.mark.slow
def test_multimodal_layout_and_cli_conversion(tmp_path, hf_config, layout, model, hf_fixture):
  """`language_model.` keys, vision tensors, only hf_quant_config.json; scripts/convert_hf.py
  converts it and the converted model equals the directly loaded one."""
  rng = np.random.default_rng(0)
  t = {"language_model." + k: v for k, v in layout[0].items()}
  t["vision_model.patch_embedding.linear.weight"] = rng.standard_normal((32, 48)).astype(
      np.float32)
  cfg = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
         "tie_word_embeddings": False, "text_config": hf_config,
         "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 32}}
  src = write_checkpoint(tmp_path / "hf", cfg, t, _quant_config(MM_EXCLUDE))
  # --checkpoint <HF dir> --kv_cache=fp8: the dynamic KV cache, as the `model` fixture
  direct = maverick.load(str(src), dtype="float32", kv_cache="fp8").model
  assert_same_params(direct, model)
  out = tmp_path / "out"
  r = _cli(f"--hf_dir={src}", f"--out_dir={out}", "--dtype=float32", "--kv_cache=fp8",
           "--text_only")  # its vision tensors are a stand-in, not a tower
  assert r.returncode == 0, r.stderr
  meta = json.loads((out / "maverick.json").read_text())
  assert meta["config"]["quant"]["activations"] == "static_per_tensor"
  assert meta["config"]["quant"]["kv_cache"] == "fp8"
  converted = maverick.load(str(out)).model  # what --checkpoint <out_dir> does
  assert_same_params(converted, model)
  inputs = jnp.asarray(hf_fixture["inputs"])
  np.testing.assert_array_equal(np.asarray(converted(inputs).logits),
                                np.asarray(model(inputs).logits))


def test_convert_dynamic_option(tmp_path, ckpt_dir, hf_fixture_dir):
  out = convert_hf_to_orbax(str(ckpt_dir), str(tmp_path / "conv"), dtype="float32",
                            progress=False, activations="dynamic_per_token", kv_cache="fp8")
  qc = load_orbax(out).config.quant
  assert (qc.activations, qc.kv_cache) == ("dynamic_per_token", "fp8")
  assert not any(k[-1].endswith("cache_scale") for k in flat_params(load_orbax(out)))
  for kw in (dict(activations="dynamic_per_token"), dict(kv_cache="fp8")):
    with pytest.raises(CheckpointError, match="not one"):  # a BF16 checkpoint has no such choice
      load_hf(str(hf_fixture_dir), **kw)


def test_kv_scales_are_checked_not_used(tmp_path, layout, hf_config, model):
  """kv_cache="fp8" keeps the dynamic per-token scales: other k/v scales give the same model;
  without kv_cache_quant_algo (and k/v scales) the KV cache stays unquantized, and the static
  mode is refused with the way out."""
  t = dict(layout[0])
  t["model.layers.2.self_attn.k_proj.k_scale"] = np.array(5.0, np.float32)
  d = write_checkpoint(tmp_path / "a", hf_config, t, _quant_config(EXCLUDE))
  assert_same_params(load_hf(str(d), dtype="float32", kv_cache="fp8"), model)
  t = {k: v for k, v in layout[0].items() if not k.endswith(("k_scale", "v_scale"))}
  d = write_checkpoint(tmp_path / "b", hf_config, t, _quant_config(EXCLUDE, kv=None))
  assert load_hf(str(d), dtype="float32").config.quant.kv_cache is None
  with pytest.raises(CheckpointError, match="sets no kv_cache_quant_algo FP8; use kv_cache 'fp8'"):
    load_hf(str(d), kv_cache="fp8_static")


def _kv_scale_without_kv_algo(t, h, c):
  h["quantization"]["kv_cache_quant_algo"] = None
  del c["quantization_config"]["kv_cache_scheme"]


def test_static_mode_is_not_made_from_bf16(fixture_model):
  with pytest.raises(quant.QuantError, match="calibrated"):
    quant.quantize_model(fixture_model, quant.QuantConfig(activations="static_per_tensor"))


# ----------------------------------------------------------------------------------------------
# Bad input: one CheckpointError naming the tensor (or the config), nothing written
# ----------------------------------------------------------------------------------------------
Q = "model.layers.2.self_attn.q_proj."
X = "model.layers.3.feed_forward.experts."


def _missing_weight_scale(t, h, c):
  del t[Q + "weight_scale"]


def _missing_input_scale(t, h, c):
  del t[X + "down_proj_input_scale"]


def _per_channel_scale(t, h, c):
  t[Q + "weight_scale"] = np.ones((128, 1), np.float32)


def _nvfp4(t, h, c):
  h["quantization"]["quant_algo"] = "NVFP4"
  c["quantization_config"]["quant_algo"] = "NVFP4"


def _excluded_fp8(t, h, c):
  n = "model.layers.0.self_attn.k_proj."
  t[n + "weight"] = t[n + "weight"].astype(E4M3)
  t[n + "weight_scale"] = np.array(1.0, np.float32)
  t[n + "input_scale"] = np.array(1.0, np.float32)


def _unexcluded_bf16(t, h, c):
  h["quantization"]["exclude_modules"] = ["lm_head"]
  c["quantization_config"]["ignore"] = ["lm_head"]


def _zero_input_scale(t, h, c):
  t[X + "gate_up_proj_input_scale"] = np.array(0.0, np.float32)


def _zero_weight_scale(t, h, c):  # converted silently before, zeroing the layer
  t[Q + "weight_scale"] = np.array(0.0, np.float32)


def _disagree(t, h, c):
  c["quantization_config"]["quant_algo"] = "FP8_PER_CHANNEL_PER_TOKEN"


def _kv_scale_shape(t, h, c):
  t["model.layers.4.self_attn.k_proj.k_scale"] = np.ones((2,), np.float32)


def _kv_scale_missing(t, h, c):
  del t["model.layers.5.self_attn.v_proj.v_scale"]


@pytest.mark.slow
@pytest.mark.parametrize("mutate,words", [
    (_missing_weight_scale, [Q + "weight", Q + "weight_scale", "missing"]),
    (_missing_input_scale, [X + "down_proj", X + "down_proj_input_scale", "missing"]),
    (_per_channel_scale, [Q + "weight_scale", "[128, 1]", "per-tensor"]),
    (_nvfp4, ["quant_algo 'NVFP4'", "not supported"]),
    (_excluded_fp8, ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn*",
                     "BF16"]),
    (_unexcluded_bf16, ["model.layers.0.self_attn", "exclude_modules"]),
    (_zero_input_scale, [X + "gate_up_proj_input_scale", "> 0"]),
    (_zero_weight_scale, [Q + "weight_scale", "is 0.0", "> 0"]),
    (_disagree, ["hf_quant_config.json", "disagree"]),
    (_kv_scale_shape, ["model.layers.4.self_attn.k_proj.k_scale", "[2]"]),
    (_kv_scale_missing, ["model.layers.5.self_attn.v_proj.v_scale", "missing", "kv_cache='fp8'"]),
    (_kv_scale_without_kv_algo, ["model.layers.0.self_attn.k_proj.k_scale",
                                 "kv_cache_quant_algo"]),
], ids=["weight_scale_missing", "input_scale_missing", "per_channel_scale", "nvfp4",
        "excluded_fp8", "unexcluded_bf16", "zero_input_scale", "zero_weight_scale", "configs_disagree",
        "kv_scale_shape", "kv_scale_missing", "kv_scale_without_kv_algo"])
def test_bad_modelopt_checkpoints(tmp_path, layout, hf_config, mutate, words):
  t = dict(layout[0])
  h = json.loads(json.dumps(_quant_config(EXCLUDE)))
  c = {"quantization_config": _config_json_form(EXCLUDE)}
  mutate(t, h, c)
  d = write_checkpoint(tmp_path / "hf", hf_config, t, h, c["quantization_config"])
  out = tmp_path / "out"
  with pytest.raises(CheckpointError) as e:
    convert_hf_to_orbax(str(d), str(out), progress=False)
  for w in words:
    assert w in str(e.value), (w, str(e.value))
  _assert_no_output(out)
  with pytest.raises(CheckpointError):
    load_hf(str(d))


@pytest.mark.parametrize("kv", [True, False])
def test_modelopt_tensors_without_quant_config(tmp_path, layout, hf_config, kv):
  """ModelOpt's tensors with hf_quant_config.json lost (and no quantization_config in config.json)
  name the missing file and what it holds, not a compressed-tensors scale-shape error."""
  t = layout[0] if kv else {k: v for k, v in layout[0].items()
                            if not k.endswith(("k_scale", "v_scale"))}
  d = write_checkpoint(tmp_path / "hf", hf_config, t, None)
  out = tmp_path / "out"
  with pytest.raises(CheckpointError) as e:
    convert_hf_to_orbax(str(d), str(out), progress=False)
  _assert_no_output(out)
  msg = str(e.value)
  kv_algo = '"kv_cache_quant_algo": ' + ('"FP8"' if kv else "null")
  for w in (str(d), "ModelOpt", "no hf_quant_config.json", '"quant_algo": "FP8"', kv_algo,
            "exclude_modules", "model.layers."):
    assert w in msg, (w, msg)
  assert "\n" not in msg
  with pytest.raises(CheckpointError, match="no hf_quant_config.json"):
    load_hf(str(d))


def test_cli_reports_modelopt_error(tmp_path, layout, hf_config):
  t = dict(layout[0])
  _missing_input_scale(t, None, None)
  d = write_checkpoint(tmp_path / "hf", hf_config, t, _quant_config(EXCLUDE))
  r = _cli(f"--hf_dir={d}", f"--out_dir={tmp_path / 'out'}")
  _one_line_error(r, X + "down_proj_input_scale")
  _assert_no_output(tmp_path / "out")
