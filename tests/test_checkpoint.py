"""HF safetensors import, the orbax format, and scripts/convert_hf.py.

Correctness is judged against the HF golden logits of the tiny fixture and, for layouts the fixture
lacks (tied embeddings, top-2, MoE on every layer), against an independent float64 NumPy
implementation of spec §2-3 that reads only the HF config dict and HF-named tensors.
"""

import json
import math
import os
import pathlib
import shutil
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from param_utils import assert_same_params, flat_params
from safetensors.numpy import load_file, save_file

from maverick import config as config_lib
from maverick import model as model_lib
from maverick.checkpoint import (
  CheckpointError,
  convert_hf_to_orbax,
  hf,
  load_hf,
  load_orbax,
  save_orbax,
  store,
)
from maverick.checkpoint import hf as hf_lib
from maverick.config import ConfigError

REPO = pathlib.Path(__file__).resolve().parent.parent
CLI = REPO / "scripts" / "convert_hf.py"
ATOL = 1e-4  # acceptance tolerance vs. the HF float32 logits (observed ~6e-6)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------


def _logits(model, inputs) -> np.ndarray:
  return np.asarray(model(jnp.asarray(inputs)).logits)


def _read_config(d) -> dict:
  return json.loads((pathlib.Path(d) / "config.json").read_text())


def _write_hf(d, config: dict, tensors: dict, *, shards: int = 1):
  """Writes an HF-style checkpoint folder: config.json and one file or `shards` shards + index."""
  d = pathlib.Path(d)
  d.mkdir(parents=True, exist_ok=True)
  (d / "config.json").write_text(json.dumps(config, indent=1))
  if shards == 1:
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d
  names = sorted(tensors)
  weight_map = {}
  for s in range(shards):
    fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    # Round-robin, so one layer's tensors are spread over several shards.
    part = {n: tensors[n] for n in names[s::shards]}
    save_file(part, str(d / fname), metadata={"format": "pt"})
    weight_map.update({n: fname for n in part})
  total = sum(t.nbytes for t in tensors.values())
  (d / hf.INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total},
                                             "weight_map": weight_map}))
  return d


def _assert_no_output(out):
  out = pathlib.Path(out)
  assert not out.exists()
  assert not list(out.parent.glob(out.name + ".tmp-*"))
  assert not list(out.parent.glob(out.name + ".old-*"))


# ----------------------------------------------------------------------------------------------
# Independent float64 NumPy reference (spec §2-3), HF config dict + HF tensor names only
# ----------------------------------------------------------------------------------------------
def np_forward(cfg: dict, t: dict, ids: np.ndarray, act=None, kv=None) -> np.ndarray:
  """act(x, module): optional hook applied to the input of every linear / expert product (named
  by its HF module, e.g. `model.layers.0.self_attn.q_proj`, `...feed_forward.experts.down_proj`):
  activation quantization or calibration; None = identity. kv(x, "k" or "v", layer): the same for
  the keys and values attention reads (after RoPE and QK norm): KV-cache quantization."""
  f = lambda n: t[n].astype(np.float64)
  a = (lambda x, n: x) if act is None else act
  L, D = cfg["num_hidden_layers"], cfg["hidden_size"]
  H, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  Dh = cfg.get("head_dim") or D // H
  eps, C = cfg.get("rms_norm_eps", 1e-5), cfg["attention_chunk_size"]
  interval, step = cfg.get("no_rope_layer_interval", 4), cfg.get("interleave_moe_layer_step", 1)
  no_rope = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(L)]
  moe = cfg.get("moe_layers")
  moe = list(range(step - 1, L, step)) if moe is None else moe
  types = cfg.get("layer_types") or ["chunked_attention" if r else "full_attention"
                                     for r in no_rope]
  rp = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
  inv = 1.0 / rp["rope_theta"] ** (np.arange(0, Dh, 2) / Dh)
  if rp["rope_type"] == "llama3":
    fac, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
    old = rp["original_max_position_embeddings"]
    wl = 2 * math.pi / inv
    with np.errstate(divide="ignore", invalid="ignore"):
      s = (old / wl - lo) / (hi - lo)
    inv = np.where(wl > old / lo, inv / fac,
                   np.where(wl < old / hi, inv, (1 - s) * inv / fac + s * inv))
  B, T = ids.shape
  pos = np.arange(T)
  silu = lambda z: z / (1 + np.exp(-z))
  lin = lambda x, n: a(x, n.removesuffix(".weight")) @ f(n).T

  def rms(x, w=None):
    y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
    return y if w is None else y * w

  def rope(x):  # interleaved pairs (x[2j], x[2j+1])
    a = pos[:, None] * inv[None]
    c, s = np.cos(a)[None, :, None], np.sin(a)[None, :, None]
    out = np.empty_like(x)
    out[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    out[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
    return out

  def mlp(x, p):
    return lin(silu(lin(x, p + "gate_proj.weight")) * lin(x, p + "up_proj.weight"),
               p + "down_proj.weight")

  causal = pos[None, :] <= pos[:, None]  # [query, key]
  chunked = causal & (pos[:, None] // C == pos[None, :] // C)
  x = f("model.embed_tokens.weight")[ids]
  for i in range(L):
    p = f"model.layers.{i}."
    h = rms(x, f(p + "input_layernorm.weight"))
    q = lin(h, p + "self_attn.q_proj.weight").reshape(B, T, H, Dh)
    k = lin(h, p + "self_attn.k_proj.weight").reshape(B, T, K, Dh)
    v = lin(h, p + "self_attn.v_proj.weight").reshape(B, T, K, Dh)
    if no_rope[i]:
      q, k = rope(q), rope(k)
      if cfg.get("use_qk_norm", True):
        q, k = rms(q), rms(k)
    elif cfg.get("attn_temperature_tuning", True):
      scale = np.log1p(np.floor((pos + 1.0) / cfg["floor_scale"])) * cfg["attn_scale"] + 1.0
      q = q * scale[None, :, None, None]
    if kv is not None:
      k, v = kv(k, "k", i), kv(v, "v", i)
    k, v = np.repeat(k, H // K, axis=2), np.repeat(v, H // K, axis=2)  # head j -> kv j // G
    s = np.einsum("bihd,bjhd->bhij", q, k) * Dh ** -0.5
    s = np.where(chunked if types[i] == "chunked_attention" else causal, s, -np.inf)
    pr = np.exp(s - s.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    o = np.einsum("bhij,bjhd->bihd", pr, v).reshape(B, T, H * Dh)
    x = x + lin(o, p + "self_attn.o_proj.weight")
    h = rms(x, f(p + "post_attention_layernorm.weight"))
    fp = p + "feed_forward."
    if i in moe:
      hn = h.reshape(B * T, D)
      r = lin(hn, fp + "router.weight")
      top = np.argsort(-r, axis=-1, kind="stable")[:, :cfg.get("num_experts_per_tok", 1)]
      out = mlp(hn, fp + "shared_expert.")
      gu, dn = f(fp + "experts.gate_up_proj"), f(fp + "experts.down_proj")
      F = dn.shape[1]
      for e in range(gu.shape[0]):
        rows = np.nonzero((top == e).any(-1))[0]
        z = hn[rows] / (1 + np.exp(-r[rows, e:e + 1]))  # sigmoid score scales the INPUT
        g = a(z, fp + "experts.gate_up_proj") @ gu[e]
        out[rows] += a(silu(g[:, :F]) * g[:, F:], fp + "experts.down_proj") @ dn[e]
      h = out.reshape(B, T, D)
    else:
      h = mlp(h, fp)
    x = x + h
  x = rms(x, f("model.norm.weight"))
  head = f("model.embed_tokens.weight") if cfg.get("tie_word_embeddings") else f("lm_head.weight")
  return x @ head.T


def random_hf_tensors(c: config_lib.Config, rng: np.random.Generator) -> dict:
  """HF-named float32 tensors of a random Llama 4 text model with config `c` (dense or MoE
  feed-forward per layer as `c` says; lm_head included)."""
  D, H, K, Dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
  F, E = c.intermediate_size, c.num_local_experts
  w = lambda *s, std=0.1: (rng.standard_normal(s) * std).astype(np.float32)
  norm = lambda: (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
  mlp = lambda p, width: {p + "gate_proj.weight": w(width, D), p + "up_proj.weight": w(width, D),
                          p + "down_proj.weight": w(D, width)}
  t = {"model.embed_tokens.weight": w(c.vocab_size, D, std=0.3), "model.norm.weight": norm()}
  for i in range(c.num_hidden_layers):
    p = f"model.layers.{i}."
    t |= {p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
          p + "self_attn.q_proj.weight": w(H * Dh, D), p + "self_attn.k_proj.weight": w(K * Dh, D),
          p + "self_attn.v_proj.weight": w(K * Dh, D), p + "self_attn.o_proj.weight": w(D, H * Dh)}
    if c.is_moe(i):
      t |= {p + "feed_forward.router.weight": w(E, D, std=0.3),
            p + "feed_forward.experts.gate_up_proj": w(E, D, 2 * F),
            p + "feed_forward.experts.down_proj": w(E, F, D),
            **mlp(p + "feed_forward.shared_expert.", F)}
    else:
      t |= mlp(p + "feed_forward.", c.intermediate_size_mlp)
  t["lm_head.weight"] = w(c.vocab_size, D, std=0.3)  # drawn last: a tied model drops it
  return t


def _tied_checkpoint(d) -> tuple[dict, dict]:
  """A random HF checkpoint with tied embeddings (no lm_head.weight), top-2, MoE on every layer,
  NoPE every 3rd layer, from `tiny_top2_tied` values; config has only interval/step."""
  c = config_lib.tiny_top2_tied()
  cfg = {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text",
         "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
         "intermediate_size": c.intermediate_size,
         "intermediate_size_mlp": c.intermediate_size_mlp,
         "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
         "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
         "num_local_experts": c.num_local_experts, "num_experts_per_tok": c.num_experts_per_tok,
         "interleave_moe_layer_step": c.interleave_moe_layer_step,
         "tie_word_embeddings": True, "attention_chunk_size": c.attention_chunk_size,
         "no_rope_layer_interval": c.no_rope_layer_interval,
         "attn_temperature_tuning": False, "use_qk_norm": False, "rms_norm_eps": 1e-5,
         "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
         "hidden_act": "silu", "dtype": "float32"}
  t = random_hf_tensors(c, np.random.default_rng(0))
  del t["lm_head.weight"]  # tied
  _write_hf(d, cfg, t)
  return cfg, t


# ----------------------------------------------------------------------------------------------
# Module fixtures: convert once, reuse
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tmp_path_factory, hf_fixture_dir):
  out = tmp_path_factory.mktemp("converted") / "tiny"
  assert convert_hf_to_orbax(str(hf_fixture_dir), str(out), progress=False) == str(out)
  return out


@pytest.fixture(scope="module")
def converted_model(converted):
  return load_orbax(str(converted), dtype="float32")


@pytest.fixture(scope="module")
def fixture_tensors(hf_fixture_dir):
  return load_file(str(hf_fixture_dir / "model.safetensors"))


# ----------------------------------------------------------------------------------------------
# Round trips against the HF golden logits
# ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_converted_checkpoint_matches_hf_logits(converted_model, hf_fixture):
  """Acceptance: HF -> orbax -> load -> float32 forward matches transformers within 1e-4."""
  got = _logits(converted_model, hf_fixture["inputs"])
  assert got.shape == hf_fixture["logits"].shape
  np.testing.assert_allclose(got, hf_fixture["logits"], rtol=0, atol=ATOL)


def test_converted_params_equal_load_hf(converted_model, fixture_model):
  assert_same_params(converted_model, fixture_model)


def test_converted_directory(converted, hf_fixture_dir):
  meta = store.read_meta(str(converted))
  assert meta["format"] == store.FORMAT
  cfg = config_lib.Config.from_dict(meta["config"])
  assert cfg == config_lib.from_hf(hf_fixture_dir)
  assert sorted(meta["parts"]) == ["embed", "head"] + [f"layer_{i:03d}" for i in range(8)]
  assert sorted(os.listdir(converted / "params")) == sorted(meta["parts"])
  # Tokenizer-side files travel with the weights.
  assert (converted / "generation_config.json").read_text() == (
      hf_fixture_dir / "generation_config.json").read_text()
  assert store.is_orbax_checkpoint(str(converted))
  assert not store.is_orbax_checkpoint(str(hf_fixture_dir))


def test_gate_up_split_is_halves(converted_model, fixture_tensors):
  """Our expert gate/up are the first/second half of HF's fused gate_up_proj (last axis)."""
  cfg = converted_model.config
  F = cfg.intermediate_size
  for i in cfg.moe_layers:
    raw = fixture_tensors[f"model.layers.{i}.feed_forward.experts.gate_up_proj"]
    assert raw.shape == (cfg.num_local_experts, cfg.hidden_size, 2 * F)
    ffn = converted_model.layers[i].ffn
    np.testing.assert_array_equal(np.asarray(ffn.gate[...]), raw[:, :, :F])
    np.testing.assert_array_equal(np.asarray(ffn.up[...]), raw[:, :, F:])
    down = fixture_tensors[f"model.layers.{i}.feed_forward.experts.down_proj"]
    np.testing.assert_array_equal(np.asarray(ffn.down[...]), down)
    # Router and shared expert are nn.Linear ([out, in]); we store [in, out].
    np.testing.assert_array_equal(np.asarray(ffn.router[...]),
                                  fixture_tensors[f"model.layers.{i}.feed_forward.router.weight"].T)


@pytest.mark.slow
def test_sharded_multimodal_checkpoint(tmp_path, hf_fixture_dir, fixture_tensors, hf_fixture,
                                       converted_model):
  """3 shards + index, every key under `language_model.`, vision tensors present and skipped,
  multimodal config.json."""
  rng = np.random.default_rng(0)
  tensors = {"language_model." + k: v for k, v in fixture_tensors.items()}
  tensors["vision_model.patch_embedding.linear.weight"] = rng.standard_normal(
      (32, 48)).astype(np.float32)
  tensors["multi_modal_projector.linear_1.weight"] = rng.standard_normal(
      (64, 32)).astype(np.float32)
  cfg = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
         "tie_word_embeddings": False, "text_config": _read_config(hf_fixture_dir),
         "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 32}}
  src = _write_hf(tmp_path / "hf", cfg, tensors, shards=3)
  assert len(list(src.glob("model-*-of-00003.safetensors"))) == 3

  out = tmp_path / "out"
  convert_hf_to_orbax(str(src), str(out), progress=False)
  model = load_orbax(str(out), dtype="float32")
  assert_same_params(model, converted_model)
  np.testing.assert_allclose(_logits(model, hf_fixture["inputs"]), hf_fixture["logits"],
                             rtol=0, atol=ATOL)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoint(tmp_path, hf_fixture_dir, fixture_tensors, fixture_model, dtype):
  """Real checkpoints are BF16: they must be read (numpy has no native bfloat16)."""
  np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
  cfg = _read_config(hf_fixture_dir) | {"dtype": dtype}
  src = _write_hf(tmp_path / "hf", cfg, {k: v.astype(np_dtype) for k, v in fixture_tensors.items()})
  out = tmp_path / "out"
  convert_hf_to_orbax(str(src), str(out), progress=False)  # dtype from config.json
  model = load_orbax(str(out))
  assert model.config.dtype == dtype
  got, ref = flat_params(model), flat_params(fixture_model)
  assert got.keys() == ref.keys()
  for p in ref:  # layout changes only: exactly the rounded fixture values
    assert got[p].dtype == np_dtype, p
    np.testing.assert_array_equal(got[p].astype(np.float32),
                                  ref[p].astype(np_dtype).astype(np.float32), err_msg=str(p))
  # Explicit --dtype float32 from a half-precision source.
  up = load_hf(str(src), dtype="float32")
  for p, v in flat_params(up).items():
    assert v.dtype == np.float32
    np.testing.assert_array_equal(v, ref[p].astype(np_dtype).astype(np.float32))


# ----------------------------------------------------------------------------------------------
# Tied embeddings, against the NumPy reference
# ----------------------------------------------------------------------------------------------
def test_numpy_reference_matches_hf_fixture(hf_fixture_dir, fixture_tensors, hf_fixture):
  """Validates the reference itself before it is trusted for the tied checkpoint."""
  ref = np_forward(_read_config(hf_fixture_dir), fixture_tensors, hf_fixture["inputs"])
  np.testing.assert_allclose(ref, hf_fixture["logits"], rtol=0, atol=2e-5)


@pytest.mark.slow
def test_tied_embeddings_checkpoint(tmp_path):
  cfg, tensors = _tied_checkpoint(tmp_path / "hf")
  assert "lm_head.weight" not in tensors
  out = tmp_path / "out"
  convert_hf_to_orbax(str(tmp_path / "hf"), str(out), progress=False)
  model = load_orbax(str(out))
  c = model.config
  assert c.tie_word_embeddings and not hasattr(model, "lm_head")
  assert c.moe_layers == tuple(range(6)) and c.num_experts_per_tok == 2
  assert [i for i in range(6) if not c.uses_rope(i)] == [2, 5]

  ids = np.random.default_rng(1).integers(0, c.vocab_size, size=(2, 20)).astype(np.int32)
  ref = np_forward(cfg, tensors, ids)
  assert np.abs(ref).max() > 1.0  # not a degenerate model
  out_ = model(jnp.asarray(ids), capture_layers=(c.num_hidden_layers - 1,))
  np.testing.assert_allclose(np.asarray(out_.logits), ref, rtol=0, atol=ATOL)
  # The head is the embedding: logits == final_norm(last hidden) @ embed.T.
  h = np.asarray(out_.hidden[0], np.float64)
  h = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + 1e-5) * tensors["model.norm.weight"]
  np.testing.assert_allclose(np.asarray(out_.logits), h @ tensors["model.embed_tokens.weight"].T,
                             rtol=0, atol=ATOL)


# ----------------------------------------------------------------------------------------------
# Bad input: clear errors, nothing written
# ----------------------------------------------------------------------------------------------
def _case_missing(t):
  del t["model.layers.2.self_attn.k_proj.weight"]


def _case_extra(t):
  t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.linspace(1, 2, 16, dtype=np.float32)


def _case_shape(t):
  t["model.layers.4.self_attn.q_proj.weight"] = np.ascontiguousarray(
      t["model.layers.4.self_attn.q_proj.weight"].T)


def _case_dtype(t):
  t["model.norm.weight"] = np.arange(1, 65, dtype=np.int32)


def _case_untied_lm_head_missing(t):
  del t["lm_head.weight"]


@pytest.mark.parametrize("mutate,words", [
    (_case_missing, ["missing", "model.layers.2.self_attn.k_proj.weight"]),
    (_case_extra, ["unexpected", "model.layers.0.self_attn.rotary_emb.inv_freq"]),
    (_case_shape, ["model.layers.4.self_attn.q_proj.weight", "[64, 128]", "[128, 64]"]),
    (_case_dtype, ["model.norm.weight", "I32"]),
    (_case_untied_lm_head_missing, ["missing", "lm_head.weight"]),
], ids=["missing", "extra", "shape", "dtype", "no_lm_head"])
def test_bad_tensors(tmp_path, hf_fixture_dir, fixture_tensors, mutate, words):
  t = dict(fixture_tensors)
  mutate(t)
  src = _write_hf(tmp_path / "hf", _read_config(hf_fixture_dir), t)
  out = tmp_path / "out"
  with pytest.raises(CheckpointError) as e:
    convert_hf_to_orbax(str(src), str(out), progress=False)
  for w in words:
    assert w in str(e.value), (w, str(e.value))
  _assert_no_output(out)
  with pytest.raises(CheckpointError):  # the direct loader validates the same way
    load_hf(str(src))


@pytest.mark.parametrize("keep", [4, 100, -1000], ids=["no_header", "in_header", "in_data"])
def test_truncated_safetensors(tmp_path, hf_fixture_dir, keep):
  src = tmp_path / "hf"
  src.mkdir()
  shutil.copy(hf_fixture_dir / "config.json", src)
  data = (hf_fixture_dir / "model.safetensors").read_bytes()
  (src / "model.safetensors").write_bytes(data[:keep])
  out = tmp_path / "out"
  with pytest.raises(CheckpointError) as e:
    convert_hf_to_orbax(str(src), str(out), progress=False)
  assert "truncated" in str(e.value) and "model.safetensors" in str(e.value)
  _assert_no_output(out)


def test_malformed_config_json(tmp_path, hf_fixture_dir):
  src = tmp_path / "hf"
  src.mkdir()
  shutil.copy(hf_fixture_dir / "model.safetensors", src)
  (src / "config.json").write_text(_read_config(hf_fixture_dir).__repr__())  # Python, not JSON
  out = tmp_path / "out"
  with pytest.raises(ConfigError) as e:
    convert_hf_to_orbax(str(src), str(out), progress=False)
  assert str(src / "config.json") in str(e.value) and "JSON" in str(e.value)
  _assert_no_output(out)


def test_config_contradicts_tensors(tmp_path, hf_fixture_dir, fixture_tensors):
  """config.json says MoE on even layers: the error names the missing MoE tensors."""
  cfg = _read_config(hf_fixture_dir) | {"moe_layers": [0, 2, 4, 6]}
  src = _write_hf(tmp_path / "hf", cfg, fixture_tensors)
  with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.0\.feed_forward"):
    convert_hf_to_orbax(str(src), str(tmp_path / "out"), progress=False)
  _assert_no_output(tmp_path / "out")


def test_index_lists_missing_shard(tmp_path, hf_fixture_dir, fixture_tensors):
  src = _write_hf(tmp_path / "hf", _read_config(hf_fixture_dir), fixture_tensors, shards=3)
  (src / "model-00002-of-00003.safetensors").unlink()
  out = tmp_path / "out"
  with pytest.raises(CheckpointError) as e:
    convert_hf_to_orbax(str(src), str(out), progress=False)
  assert "model-00002-of-00003.safetensors" in str(e.value) and "missing" in str(e.value)
  _assert_no_output(out)


def test_malformed_index(tmp_path, hf_fixture_dir, fixture_tensors):
  src = _write_hf(tmp_path / "hf", _read_config(hf_fixture_dir), fixture_tensors, shards=2)
  (src / hf.INDEX_FILE).write_text('{"weight_map": ["model-00001-of-00002.safetensors"]}')
  with pytest.raises(CheckpointError, match="weight_map"):
    convert_hf_to_orbax(str(src), str(tmp_path / "out"), progress=False)
  _assert_no_output(tmp_path / "out")


def test_no_weights(tmp_path, hf_fixture_dir):
  src = tmp_path / "hf"
  src.mkdir()
  shutil.copy(hf_fixture_dir / "config.json", src)
  with pytest.raises(CheckpointError, match="model.safetensors"):
    convert_hf_to_orbax(str(src), str(tmp_path / "out"), progress=False)
  _assert_no_output(tmp_path / "out")


def test_failure_mid_conversion_leaves_nothing(tmp_path, hf_fixture_dir, monkeypatch):
  out = tmp_path / "out"
  real_read = hf.SafetensorsCheckpoint.read
  seen = {"calls": 0, "parts_on_disk": None}

  def flaky_read(self, name):
    seen["calls"] += 1
    if seen["calls"] == 15:  # embed + head + most of layer_000 have been read by now
      tmps = list(tmp_path.glob("out.tmp-*"))
      seen["parts_on_disk"] = sorted(os.listdir(tmps[0] / "params")) if tmps else []
      raise OSError("simulated disk failure")
    return real_read(self, name)

  monkeypatch.setattr(hf.SafetensorsCheckpoint, "read", flaky_read)
  with pytest.raises(OSError, match="simulated disk failure"):
    convert_hf_to_orbax(str(hf_fixture_dir), str(out), progress=False)
  assert "embed" in seen["parts_on_disk"]  # the failure really came after a part was written
  _assert_no_output(out)


def test_existing_output_dir(tmp_path, hf_fixture_dir, converted):
  # A non-checkpoint directory is never replaced, even with overwrite.
  other = tmp_path / "other"
  other.mkdir()
  (other / "notes.txt").write_text("keep me")
  with pytest.raises(FileExistsError, match="already exists"):
    convert_hf_to_orbax(str(hf_fixture_dir), str(other), progress=False)
  with pytest.raises(FileExistsError, match="not a maverick checkpoint"):
    convert_hf_to_orbax(str(hf_fixture_dir), str(other), overwrite=True, progress=False)
  assert (other / "notes.txt").read_text() == "keep me"

  # A previous checkpoint: refused without overwrite, replaced with it.
  out = tmp_path / "out"
  shutil.copytree(converted, out)
  (out / "stale.txt").write_text("old")
  with pytest.raises(FileExistsError, match="already exists"):
    convert_hf_to_orbax(str(hf_fixture_dir), str(out), progress=False)
  assert (out / "stale.txt").exists()
  convert_hf_to_orbax(str(hf_fixture_dir), str(out), overwrite=True, progress=False)
  assert not (out / "stale.txt").exists() and store.is_orbax_checkpoint(str(out))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "out"]


# ----------------------------------------------------------------------------------------------
# save_orbax / load_orbax
# ----------------------------------------------------------------------------------------------
def test_save_orbax_round_trip(tmp_path):
  cfg = config_lib.tiny_top2_tied()
  model = model_lib.init_model(cfg, seed=0)
  flat = flat_params(model)
  assert all(np.any(v != 0) for v in flat.values())
  out = tmp_path / "ckpt"
  save_orbax(model, str(out))
  back = load_orbax(str(out))
  assert back.config == cfg
  assert_same_params(back, model)
  with pytest.raises(FileExistsError):
    save_orbax(model, str(out))


def test_load_orbax_with_mesh(converted, converted_model):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
  model = load_orbax(str(converted), mesh=mesh, dtype="float32")
  _, state = nnx.split(model)
  for path, var in nnx.to_flat_state(state):
    sharding = var.get_value().sharding
    assert isinstance(sharding, jax.sharding.NamedSharding), path
    assert sharding.mesh == mesh, path
  assert_same_params(model, converted_model)


def test_load_orbax_sharded_restore(converted, converted_model):
  """Restore straight into a 2-device layout (experts and vocab split)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("model",))
  model = load_orbax(str(converted), mesh=mesh, rules={"experts": "model", "vocab": "model"},
                     dtype="float32")
  gate = model.layers[1].ffn.gate[...]
  assert gate.sharding.spec == jax.sharding.PartitionSpec("model", None, None)
  assert len(gate.addressable_shards) == 2
  assert gate.addressable_shards[0].data.shape == (4, 64, 48)
  assert model.embed[...].sharding.spec == jax.sharding.PartitionSpec("model", None)
  assert_same_params(model, converted_model)


def test_load_orbax_not_a_checkpoint(tmp_path):
  with pytest.raises(CheckpointError, match="not a maverick checkpoint"):
    load_orbax(str(tmp_path))


# ----------------------------------------------------------------------------------------------
# scripts/convert_hf.py
# ----------------------------------------------------------------------------------------------
def _cli(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, str(CLI), *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)


def _one_line_error(r, *words):
  assert r.returncode == 1, r.stderr
  assert "Traceback" not in r.stderr
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert len(lines) == 1, r.stderr
  for w in words:
    assert w in lines[0], (w, lines[0])


def test_cli_converts(tmp_path, hf_fixture_dir, converted_model):
  out = tmp_path / "out"
  r = _cli(f"--hf_dir={hf_fixture_dir}", f"--out_dir={out}", "--dtype=float32")
  assert r.returncode == 0, r.stderr
  assert "Traceback" not in r.stderr
  assert_same_params(load_orbax(str(out)), converted_model)


def test_cli_bad_hf_dir(tmp_path):
  missing = tmp_path / "no_such_checkpoint"
  r = _cli(f"--hf_dir={missing}", f"--out_dir={tmp_path / 'out'}")
  _one_line_error(r, str(missing))
  _assert_no_output(tmp_path / "out")


def test_cli_checkpoint_error(tmp_path, hf_fixture_dir, fixture_tensors):
  t = dict(fixture_tensors)
  _case_missing(t)
  src = _write_hf(tmp_path / "hf", _read_config(hf_fixture_dir), t)
  r = _cli(f"--hf_dir={src}", f"--out_dir={tmp_path / 'out'}")
  _one_line_error(r, "model.layers.2.self_attn.k_proj.weight")
  _assert_no_output(tmp_path / "out")


def test_cli_existing_out_dir(tmp_path, hf_fixture_dir):
  (tmp_path / "out").mkdir()
  r = _cli(f"--hf_dir={hf_fixture_dir}", f"--out_dir={tmp_path / 'out'}")
  _one_line_error(r, "already exists", "--overwrite")


def test_cli_help():
  r = _cli("--help")
  assert "Traceback" not in r.stderr  # absl's --help exits with status 1 by design
  assert "Converts a Hugging Face Llama 4 checkpoint" in r.stdout
  for flag in ("--hf_dir", "--out_dir", "--dtype", "--[no]overwrite", "float32|bfloat16|float16"):
    assert flag in r.stdout, flag


def _with_offsets(src: pathlib.Path, dst: pathlib.Path, edit) -> None:
  """Copies a safetensors file with its header's data_offsets changed by edit(header)."""
  data = src.read_bytes()
  (n,) = struct.unpack("<Q", data[:8])
  header = json.loads(data[8:8 + n])
  edit(header)
  raw = json.dumps(header).encode()
  dst.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def _by_offset(header):
  return sorted((k for k in header if k != "__metadata__"),
                key=lambda k: header[k]["data_offsets"][0])


def _overlap_whole(header):  # a tensor pointed at the bytes of another of the same size
  names = _by_offset(header)
  size = lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0]
  a, b = next((a, b) for i, a in enumerate(names) for b in names[i + 1:] if size(a) == size(b))
  header[b]["data_offsets"] = list(header[a]["data_offsets"])


def _overlap_part(header):  # shifted 2 bytes into the tensor before it
  k = _by_offset(header)[5]
  header[k]["data_offsets"] = [o - 2 for o in header[k]["data_offsets"]]


def _negative_begin(header):  # reads the header's JSON bytes as weights
  k = _by_offset(header)[3]
  begin, end = header[k]["data_offsets"]
  header[k]["data_offsets"] = [-(end - begin), 0]


@pytest.mark.parametrize("edit, words", [
    (_overlap_whole, ["overlaps tensor"]),
    (_overlap_part, ["overlaps tensor"]),
    (_negative_begin, ["data_offsets [-", "0 <= begin <= end"]),
])
def test_safetensors_offsets_must_tile_the_data(tmp_path, hf_fixture_dir, edit, words):
  """Overlapping, partly overlapping and negative data offsets (which the size checks alone let
  through) are refused before any tensor is read, as the safetensors library refuses them."""
  import safetensors.numpy
  src = tmp_path / "hf"
  src.mkdir()
  shutil.copy(hf_fixture_dir / "config.json", src)
  _with_offsets(hf_fixture_dir / "model.safetensors", src / "model.safetensors", edit)
  with pytest.raises(Exception):  # the independent reference agrees the file is invalid
    safetensors.numpy.load_file(src / "model.safetensors")
  out = tmp_path / "out"
  for load in (lambda: convert_hf_to_orbax(str(src), str(out), progress=False),
               lambda: load_hf(str(src))):
    with pytest.raises(CheckpointError) as e:
      load()
    assert "model.safetensors" in str(e.value) and "re-download" in str(e.value)
    for w in words:
      assert w in str(e.value), (w, str(e.value))
  _assert_no_output(out)


def _with_nonfinite(t, name, value, where):
  w = np.array(t[name], copy=True)
  w.reshape(-1)[list(where)] = value
  t[name] = w


@pytest.mark.parametrize("name, value, where, dtype, count", [
    ("model.layers.1.self_attn.q_proj.weight", np.nan, [7], np.float32, 1),
    ("model.embed_tokens.weight", np.inf, [0, 5, 99], ml_dtypes.bfloat16, 3),
    ("model.layers.3.feed_forward.experts.down_proj", -np.inf, [2, 4], np.float16, 2),
], ids=["nan_q_proj_f32", "inf_embed_bf16", "neg_inf_down_f16"])
def test_nonfinite_weights_are_refused(tmp_path, hf_fixture_dir, fixture_tensors, name, value,
                                       where, dtype, count):
  """One NaN in a q_proj or an inf in embed_tokens used to convert and load silently (greedy output
  all token 0): both paths now stop naming the tensor and the count; --nocheck_finite loads it."""
  t = {k: v.astype(dtype) for k, v in fixture_tensors.items()}
  _with_nonfinite(t, name, value, where)
  src = _write_hf(tmp_path / "hf", _read_config(hf_fixture_dir), t)
  out = tmp_path / "out"
  for load in (lambda **kw: convert_hf_to_orbax(str(src), str(out), progress=False, **kw),
               lambda **kw: load_hf(str(src), **kw)):
    with pytest.raises(CheckpointError) as e:
      load()
    assert f"tensor {name} has {count} NaN/inf value(s)" in str(e.value), str(e.value)
    assert "--nocheck_finite" in str(e.value)
  _assert_no_output(out)
  load_hf(str(src), check_finite=False)  # trusted: the scan is skipped


def test_count_nonfinite_matches_numpy():
  """The bit-pattern count against np.isfinite, for every readable dtype (FP8: its NaN codes)."""
  rng = np.random.default_rng(4)
  x = rng.standard_normal(5000).astype(np.float32)
  x[rng.choice(5000, 40, replace=False)] = rng.choice([np.nan, np.inf, -np.inf], 40)
  for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
    y = x.astype(dtype)
    want = int(np.count_nonzero(~np.isfinite(y.astype(np.float64))))
    assert hf_lib.count_nonfinite(y, chunk=333) == want == 40
  f8 = np.nan_to_num(x, nan=1.0, posinf=2.0, neginf=-2.0).astype(ml_dtypes.float8_e4m3fn)
  bits = f8.view(np.uint8)
  bits[:7] = 0x7F
  bits[7:10] = 0xFF  # both NaN encodings of e4m3fn (it has no inf)
  assert hf_lib.count_nonfinite(f8) == 10


def _start_conversion_and_signal(hf_dir, out, sig):
  """Starts scripts/convert_hf.py and sends `sig` once its first layer has been written."""
  import signal
  import time
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.Popen([sys.executable, str(CLI), f"--hf_dir={hf_dir}", f"--out_dir={out}",
                        "--noprogress"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 120
  while not list(out.parent.glob(f"{out.name}.tmp-{p.pid}/params/layer_000")):
    assert p.poll() is None and time.monotonic() < deadline, p.communicate()
    time.sleep(0.002)
  p.send_signal(getattr(signal, sig))
  _, err = p.communicate(timeout=120)
  return p, err


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupted_conversion_cleans_up_with_one_line(tmp_path, hf_fixture_dir, sig):
  """Ctrl-C and SIGTERM stop at the next tensor, remove the temporary output and print one line
  (raising from the signal handler used to surface as thread tracebacks / a SystemError)."""
  out = tmp_path / "out"
  p, err = _start_conversion_and_signal(hf_fixture_dir, out, sig)
  assert p.returncode == 1, err
  assert err.strip() == f"convert_hf: error: interrupted; nothing was written to {out}", err
  assert sorted(tmp_path.iterdir()) == []


def test_killed_conversion_is_cleaned_and_redone_identically(tmp_path, hf_fixture_dir, converted,
                                                             capsys):
  """SIGKILL runs no cleanup: the next conversion to the same output removes the dead run's
  temporary (and says so) and writes the same checkpoint as an uninterrupted run."""
  out = tmp_path / "out"
  p, _ = _start_conversion_and_signal(hf_fixture_dir, out, "SIGKILL")
  leftover = tmp_path / f"out.tmp-{p.pid}"
  assert p.returncode == -9 and leftover.is_dir() and not out.exists()
  convert_hf_to_orbax(str(hf_fixture_dir), str(out), progress=False)
  err = capsys.readouterr().err
  assert f"removed {leftover}, left by an interrupted run (process {p.pid} is gone)" in err
  assert sorted(x.name for x in tmp_path.iterdir()) == ["out"]
  assert_same_params(load_orbax(str(out)), load_orbax(str(converted)))
  assert store.read_meta(str(out)) == store.read_meta(str(converted))
  assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in converted.iterdir())


def test_output_being_written_by_a_live_process_is_refused(tmp_path, hf_fixture_dir):
  busy = tmp_path / f"out.tmp-{os.getppid()}"  # a process that is alive
  busy.mkdir()
  with pytest.raises(FileExistsError, match=f"{busy} is being written by process {os.getppid()}"):
    convert_hf_to_orbax(str(hf_fixture_dir), str(tmp_path / "out"), progress=False)
  assert busy.is_dir()
