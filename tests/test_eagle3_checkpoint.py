"""EAGLE-3 draft checkpoints: native orbax format, HF EAGLE-3 layout import/export, validation.

The import is judged against an independent float64 NumPy implementation of the HF EAGLE-3 layer
(rotate-half RoPE, spec §2 dataflow) that reads only config.json and the HF-named tensors.
"""

import json
import os
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from param_utils import assert_same_params, flat_params
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from maverick import config as config_lib
from maverick.checkpoint import CheckpointError
from spec_decode import checkpoint as ckpt_lib
from spec_decode.draft import DraftConfigError, Eagle3Config, init_draft

V, VD = 512, 200  # tiny() vocabulary; a reduced draft vocabulary


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------
def _target(rope_scaling: bool = True) -> config_lib.Config:
  cfg = config_lib.tiny()
  return cfg if rope_scaling else cfg.replace(rope_scaling=None, rope_theta=10000.0)


def _make_draft(cfg, vd, seed=0):
  draft = init_draft(Eagle3Config.for_target(cfg, draft_vocab_size=vd), seed)
  rng = np.random.default_rng(seed)
  # Norm weights start at ones: randomise them so a swapped norm cannot pass unnoticed.
  for norm in (draft.embed_norm, draft.hidden_norm, draft.layer.post_attn_norm,
               draft.final_norm):
    norm.weight.set_value(jnp.asarray(1 + 0.5 * rng.standard_normal(cfg.hidden_size),
                                      jnp.float32))
  if vd < cfg.vocab_size:
    used = np.sort(rng.choice(cfg.vocab_size, vd, replace=False))
    draft.d2t.set_value(jnp.asarray(used - np.arange(vd), jnp.int32))
  return draft


def _inputs(cfg, seed=1, B=2, T=7):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, (B, T))
  feats = rng.standard_normal((B, T, 3 * cfg.hidden_size))
  embed = rng.standard_normal((cfg.vocab_size, cfg.hidden_size))
  return tokens, feats, embed


def _run(draft, tokens, feats, embed) -> np.ndarray:
  """The extend path (fc over target features), no cache, positions 0..T-1."""
  out = draft(jnp.asarray(tokens), draft.fuse(jnp.asarray(feats, jnp.float32)),
              jnp.asarray(embed, jnp.float32))
  return np.asarray(out.logits)




def _no_output(out: pathlib.Path):
  assert not out.exists()
  assert not [p for p in out.parent.iterdir() if p.name.startswith(out.name + ".")]


def _hf_reference(c, w, tokens, feats, embed):
  """float64 HF EAGLE-3 draft layer (LlamaDecoderLayer with a 2D-wide q/k/v input), from the
  HF config dict `c` and HF-named tensors `w` only; returns logits over the draft vocabulary."""
  f = lambda n: np.asarray(w[n], np.float64)
  m = "midlayer."
  eps, H, K = c["rms_norm_eps"], c["num_attention_heads"], c["num_key_value_heads"]
  Dh = c.get("head_dim") or c["hidden_size"] // H
  B, T = tokens.shape
  rms = lambda x, g: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g
  rotate_half = lambda x: np.concatenate([-x[..., Dh // 2:], x[..., :Dh // 2]], -1)

  hin = feats @ f("fc.weight").T
  x = np.concatenate([rms(embed[tokens], f(m + "input_layernorm.weight")),
                      rms(hin, f(m + "hidden_norm.weight"))], -1)
  q = (x @ f(m + "self_attn.q_proj.weight").T).reshape(B, T, H, Dh)
  k = (x @ f(m + "self_attn.k_proj.weight").T).reshape(B, T, K, Dh)
  v = (x @ f(m + "self_attn.v_proj.weight").T).reshape(B, T, K, Dh)
  inv_freq = 1.0 / c.get("rope_theta", 10000.0) ** (np.arange(0, Dh, 2) / Dh)
  ang = np.arange(T)[:, None] * inv_freq[None]
  ang = np.concatenate([ang, ang], -1)[None, :, None, :]  # HF: emb = cat(freqs, freqs)
  q = q * np.cos(ang) + rotate_half(q) * np.sin(ang)
  k = k * np.cos(ang) + rotate_half(k) * np.sin(ang)
  k, v = np.repeat(k, H // K, axis=2), np.repeat(v, H // K, axis=2)  # repeat_kv
  s = np.einsum("bthd,bshd->bhts", q, k) * Dh ** -0.5
  s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  att = np.einsum("bhts,bshd->bthd", p, v).reshape(B, T, H * Dh)
  att = att @ f(m + "self_attn.o_proj.weight").T
  y = hin + att  # residual = fc(features), un-normalised
  n = rms(y, f(m + "post_attention_layernorm.weight"))
  g = n @ f(m + "mlp.gate_proj.weight").T
  y = y + (g / (1 + np.exp(-g)) * (n @ f(m + "mlp.up_proj.weight").T)) @ f(
      m + "mlp.down_proj.weight").T
  return rms(y, f("norm.weight")) @ f("lm_head.weight").T


def _edit(d: pathlib.Path, *, config=None, tensors=None):
  """Rewrites an exported (float32) checkpoint: config(dict) and tensors(dict) edit in place."""
  if config is not None:
    c = json.loads((d / "config.json").read_text())
    config(c)
    (d / "config.json").write_text(json.dumps(c))
  if tensors is not None:
    w = load_file(d / "model.safetensors")
    tensors(w)
    save_file(w, d / "model.safetensors")


@pytest.fixture(scope="module")
def target():
  return _target()


@pytest.fixture(scope="module")
def reduced(target):
  return _make_draft(target, VD, seed=3)


@pytest.fixture(scope="module")
def exported(reduced, tmp_path_factory):
  """A float32 EAGLE-3 export of the reduced-vocabulary draft (read-only: copy before editing)."""
  return pathlib.Path(ckpt_lib.export_eagle3(reduced, tmp_path_factory.mktemp("e") / "draft"))


@pytest.fixture
def copy_of(exported, tmp_path):
  def make():
    d = tmp_path / "copy"
    shutil.copytree(exported, d)
    return d
  return make


# ----------------------------------------------------------------------------------------------
# Native format
# ----------------------------------------------------------------------------------------------
def test_native_round_trip(target, reduced, tmp_path):
  out = tmp_path / "native"
  assert ckpt_lib.save_draft(reduced, str(out)) == str(out)
  assert ckpt_lib.is_native_draft(str(out)) and not ckpt_lib.is_native_draft(str(tmp_path))
  meta = json.loads((out / "eagle3.json").read_text())
  assert meta["format"] == "maverick-eagle3/1"
  assert Eagle3Config.from_dict(meta["config"]) == reduced.config

  loaded = ckpt_lib.load_draft(str(out), target_config=target)
  assert loaded.config == reduced.config
  assert_same_params(loaded, reduced)
  args = _inputs(target)
  np.testing.assert_array_equal(_run(loaded, *args), _run(reduced, *args))

  bf16 = ckpt_lib.load_draft(str(out), dtype="bfloat16")
  assert bf16.lm_head.get_value().dtype == jnp.bfloat16
  assert bf16.d2t.get_value().dtype == jnp.int32
  np.testing.assert_array_equal(bf16.d2t.get_value(), reduced.d2t.get_value())

  with pytest.raises(FileExistsError, match="already exists"):
    ckpt_lib.save_draft(reduced, str(out))
  ckpt_lib.save_draft(_make_draft(target, VD, seed=4), str(out), overwrite=True)
  assert not np.array_equal(flat_params(ckpt_lib.load_draft(str(out)))[("fc",)], flat_params(reduced)[("fc",)])
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "x.txt").write_text("keep")
  with pytest.raises(FileExistsError, match="not a maverick EAGLE-3 draft"):
    ckpt_lib.save_draft(reduced, str(tmp_path / "other"), overwrite=True)
  with pytest.raises(CheckpointError, match="no eagle3.json"):
    ckpt_lib.load_draft(str(tmp_path / "other"))


def test_failed_save_and_export_leave_nothing(reduced, target, tmp_path, monkeypatch):
  def boom(*a, **k):
    raise RuntimeError("disk full")
  monkeypatch.setattr(ckpt_lib, "_write_json", boom)
  for fn in (ckpt_lib.save_draft, ckpt_lib.export_eagle3):
    out = tmp_path / fn.__name__
    with pytest.raises(RuntimeError, match="disk full"):
      fn(reduced, str(out))
    _no_output(out)
  monkeypatch.undo()
  bad = _make_draft(target, VD, seed=5)
  bad.d2t.set_value(bad.d2t.get_value().at[7].set(V))
  for fn in (ckpt_lib.save_draft, ckpt_lib.export_eagle3):
    out = tmp_path / ("bad_" + fn.__name__)
    with pytest.raises(DraftConfigError, match=r"d2t\[7\]"):
      fn(bad, str(out))
    _no_output(out)


# ----------------------------------------------------------------------------------------------
# EAGLE-3 layout
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("vd,model_type", [(V, "llama"), (VD, "llama4_text")])
def test_export_import_round_trip(target, tmp_path, vd, model_type):
  draft = _make_draft(target, vd, seed=vd)
  out = pathlib.Path(ckpt_lib.export_eagle3(draft, str(tmp_path / "x"), model_type=model_type))
  c = json.loads((out / "config.json").read_text())
  assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["model_type"] == model_type
  assert c["draft_vocab_size"] == vd and c["vocab_size"] == V
  assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
  assert c["rope_scaling"]["rope_type"] == "llama3"
  w = load_file(out / "model.safetensors")
  if vd == V:
    assert "d2t" not in w and "t2d" not in w
  else:
    assert w["d2t"].dtype == np.int64 and w["t2d"].dtype == np.bool_
    ids = np.arange(vd) + w["d2t"]
    assert w["t2d"].sum() == vd and w["t2d"][ids].all()

  imported = ckpt_lib.import_eagle3(str(out), target)
  assert_same_params(imported, draft)
  assert imported.config.layer.intermediate_size_mlp == target.intermediate_size_mlp
  assert imported.config.layer.rope_scaling == target.rope_scaling
  args = _inputs(target)
  np.testing.assert_allclose(_run(imported, *args), _run(draft, *args), atol=1e-5, rtol=0)


def test_export_import_bfloat16(target, tmp_path):
  draft = init_draft(Eagle3Config.for_target(target, draft_vocab_size=VD, dtype="bfloat16"), 0)
  out = pathlib.Path(ckpt_lib.export_eagle3(draft, str(tmp_path / "x")))
  with safe_open(out / "model.safetensors", "np") as f:  # a standard file (header, offsets)
    assert "lm_head.weight" in f.keys() and f.metadata() == {"format": "pt"}
  assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
  imported = ckpt_lib.import_eagle3(str(out), target)  # dtype from torch_dtype
  assert_same_params(imported, draft)
  as_f32 = ckpt_lib.import_eagle3(str(out), target, dtype="float32")
  assert as_f32.fc.get_value().dtype == jnp.float32


def test_import_layers0_names_and_shards(reduced, target, copy_of):
  d = copy_of()
  w = load_file(d / "model.safetensors")
  w = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}
  os.remove(d / "model.safetensors")
  names = sorted(w)
  shards = {"model-00001-of-00002.safetensors": names[:7],
            "model-00002-of-00002.safetensors": names[7:]}
  for fname, keys in shards.items():
    save_file({k: w[k] for k in keys}, d / fname)
  (d / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
  imported = ckpt_lib.import_eagle3(str(d), target)
  assert_same_params(imported, reduced)


def test_import_matches_hf_reference(tmp_path):
  """Our imported draft (interleaved RoPE after the head-dim permutation) == HF rotate-half."""
  target = _target(rope_scaling=False)
  draft = _make_draft(target, VD, seed=11)
  out = pathlib.Path(ckpt_lib.export_eagle3(draft, str(tmp_path / "x")))
  c = json.loads((out / "config.json").read_text())
  del c["rope_theta"]  # EAGLE-3 configs often omit it: HF's default 10000 applies
  (out / "config.json").write_text(json.dumps(c))
  w = load_file(out / "model.safetensors")
  tokens, feats, embed = _inputs(target, seed=2, T=9)
  ref = _hf_reference(c, w, tokens, feats, embed)

  imported = ckpt_lib.import_eagle3(str(out), target)
  assert imported.config.layer.rope_theta == 10000.0
  np.testing.assert_allclose(_run(imported, tokens, feats, embed), ref, atol=1e-4, rtol=0)
  # The check has teeth: without the permutation (q, k as HF stores them) the result differs.
  perm = ckpt_lib._rope_perm(c["head_dim"])
  for name in ("q", "k"):
    p = getattr(imported.layer.attn, name)
    p.set_value(p.get_value()[..., np.argsort(perm)])
  assert np.abs(_run(imported, tokens, feats, embed) - ref).max() > 1e-2


def test_d2t_semantics(reduced):
  d2t = np.asarray(reduced.d2t.get_value())
  ids = np.arange(VD) + d2t
  assert (np.diff(ids) > 0).all() and ids[-1] < V and d2t.any()
  np.testing.assert_array_equal(reduced.target_ids(jnp.arange(VD)), ids)
  logits = np.random.default_rng(0).standard_normal((2, VD)).astype(np.float32)
  lifted = np.asarray(reduced.lift_logits(jnp.asarray(logits), V))
  assert lifted.shape == (2, V)
  np.testing.assert_array_equal(lifted[:, ids], logits)
  outside = np.setdiff1d(np.arange(V), ids)
  assert np.isneginf(lifted[:, outside]).all()
  np.testing.assert_array_equal(ckpt_lib.check_d2t(d2t, V), ids)
  with pytest.raises(DraftConfigError, match=r"d2t\[1\] maps draft id 1 to target id 5, which "
                                             r"draft id 0 already maps to"):
    ckpt_lib.check_d2t(np.array([5, 4, 0]), 10)
  with pytest.raises(DraftConfigError, match=r"d2t\[2\] = -3 .* outside \[0, 10\)"):
    ckpt_lib.check_d2t(np.array([0, 0, -3]), 10)


def test_import_lm_head_from_target(reduced, target, copy_of):
  d = copy_of()
  _edit(d, tensors=lambda w: w.pop("lm_head.weight"))
  with pytest.raises(CheckpointError, match="no lm_head.weight; pass target_lm_head"):
    ckpt_lib.import_eagle3(str(d), target)
  head = np.random.default_rng(0).standard_normal((target.hidden_size, V)).astype(np.float32)
  with pytest.raises(CheckpointError, match=r"target_lm_head has shape \[64, 511\]"):
    ckpt_lib.import_eagle3(str(d), target, target_lm_head=head[:, :-1])
  imported = ckpt_lib.import_eagle3(str(d), target, target_lm_head=jnp.asarray(head))
  ids = np.asarray(reduced.target_ids(jnp.arange(VD)))
  np.testing.assert_array_equal(imported.lm_head.get_value(), head[:, ids])

  # A matching embed_tokens.weight (the shared table) is accepted and ignored.
  _edit(d, tensors=lambda w: w.update({"embed_tokens.weight": np.zeros((V, 64), np.float32)}))
  ckpt_lib.import_eagle3(str(d), target, target_lm_head=head)


def _set(key, value):
  return lambda c: c.__setitem__(key, value)


def _d2t_dup(w):
  w["d2t"][3] = (w["d2t"][2] + 2) - 3


def _t2d_flip(w):
  ids = np.arange(VD) + w["d2t"]
  w["t2d"][ids[7]] = False
  w["t2d"][np.setdiff1d(np.arange(V), ids)[0]] = True


def _add(name, value):
  return lambda w: w.update({name: value})


_BAD = {
    # name: (config edit, tensor edit, error, message regex)
    "missing tensor": (None, lambda w: w.pop("midlayer.mlp.up_proj.weight"), CheckpointError,
                       r"missing tensor\(s\) \['midlayer.mlp.up_proj.weight'\]"),
    "wrong shape": (None, lambda w: w.update({"midlayer.self_attn.q_proj.weight": np.zeros(
        (128, 127), np.float32)}), CheckpointError,
                    r"q_proj.weight has shape \[128, 127\], expected \[128, 128\]"),
    "d2t out of range": (None, lambda w: w["d2t"].__setitem__(5, V - 5), DraftConfigError,
                         r"d2t\[5\] = 507 maps draft id 5 to target id 512, outside"),
    "d2t duplicate": (None, _d2t_dup, DraftConfigError, r"d2t\[3\] .* draft id 2 already"),
    "d2t float": (None, lambda w: w.update({"d2t": w["d2t"].astype(np.float32)}),
                  CheckpointError, "tensor d2t has dtype F32"),
    "t2d inconsistent": (None, _t2d_flip, DraftConfigError,
                         r"t2d is inconsistent with d2t: draft id 7"),
    "t2d count": (None, lambda w: w["t2d"].__setitem__(
        np.nonzero(~w["t2d"])[0][0], True), DraftConfigError, "t2d marks 201 target ids"),
    "no d2t": (None, lambda w: (w.pop("d2t"), w.pop("t2d")), DraftConfigError,
               "draft_vocab_size 200 < vocab_size 512 but the checkpoint has no d2t"),
    "aux ids": (lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 3, 8]),
                None, DraftConfigError, r"aux layer ids \[1, 3, 8\] are outside"),
    "aux ids repeated": (lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[1, 1, 3]), None, DraftConfigError,
                         r"eagle_aux_hidden_state_layer_ids \[1, 1, 3\] repeats a layer"),
    "aux ids not ints": (lambda c: c["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids="1,2,3"), None, DraftConfigError,
                         "must be a list of integers"),
    "target hidden": (_set("target_hidden_size", 32), None, DraftConfigError,
                      "draft expects target hidden size 32, the target has 64"),
    "hidden size": (lambda c: c.update(hidden_size=32), None, DraftConfigError,
                    "draft hidden size 32 != target hidden size 64"),
    "vocab": (_set("vocab_size", 600), None, DraftConfigError,
              "vocabulary of 600 ids, the target has 512"),
    "draft vocab type": (_set("draft_vocab_size", 200.0), None, DraftConfigError,
                         "draft_vocab_size must be an integer, got 200.0"),
    "draft vocab": (_set("draft_vocab_size", 600), None, DraftConfigError,
                    r"draft_vocab_size 600 must be in \[1, target vocab 512\]"),
    "norm_before_residual": (_set("norm_before_residual", "yes"), None, DraftConfigError,
                             "norm_before_residual must be true or false, got 'yes'"),
    "fc_norm": (_set("fc_norm", True), None, DraftConfigError,
                "fc_norm = true is not supported"),
    "fc_norm in eagle_config": (lambda c: c["eagle_config"].update(fc_norm=True), None,
                                DraftConfigError, "eagle_config.fc_norm = True is not a flag"),
    "eagle-1": (lambda c: c["eagle_config"].update(use_aux_hidden_state=False), None,
                DraftConfigError, "eagle_config.use_aux_hidden_state = false is not supported"),
    "attention_bias": (_set("attention_bias", True), None, DraftConfigError,
                       "attention_bias = true is not supported"),
    "fc.bias": (None, _add("fc.bias", np.zeros(64, np.float32)), CheckpointError,
                r"bias tensor\(s\) \['fc.bias'\]"),
    "two layers": (_set("num_hidden_layers", 2), None, DraftConfigError, "single-layer"),
    "extra tensor": (None, _add("layers.1.mlp.up_proj.weight", np.zeros(3, np.float32)),
                     CheckpointError, r"unexpected tensor\(s\) \['layers.1.mlp.up_proj.weight'\]"),
    "alias twice": (None, lambda w: w.update({"layers.0.hidden_norm.weight": np.ones(
        64, np.float32)}), CheckpointError, "midlayer.hidden_norm.weight appears twice"),
    "embed shape": (None, _add("embed_tokens.weight", np.zeros((V, 32), np.float32)),
                    CheckpointError, r"embed_tokens.weight has shape \[512, 32\]"),
    "missing field": (lambda c: c.pop("hidden_size"), None, DraftConfigError,
                      r"missing required field\(s\) \['hidden_size'\]"),
    "bad field type": (_set("num_key_value_heads", "2"), None, DraftConfigError,
                       "num_key_value_heads must be a positive integer"),
    "bad rope": (_set("rope_scaling", {"rope_type": "yarn", "factor": 2.0}), None,
                 DraftConfigError, "rope_type 'yarn' is not supported"),
}


@pytest.mark.parametrize("case", sorted(_BAD))
def test_import_rejects(case, target, copy_of):
  config, tensors, error, message = _BAD[case]
  d = copy_of()
  _edit(d, config=config, tensors=tensors)
  with pytest.raises(error, match=message):
    ckpt_lib.import_eagle3(str(d), target)


def test_import_rejects_bad_config_file(target, copy_of, tmp_path):
  d = copy_of()
  (d / "config.json").write_text('{"hidden_size": 64,')
  with pytest.raises(DraftConfigError, match="config.json is not valid JSON"):
    ckpt_lib.import_eagle3(str(d), target)
  (d / "config.json").write_text("[1, 2]")
  with pytest.raises(DraftConfigError, match="expected a JSON object"):
    ckpt_lib.import_eagle3(str(d), target)
  os.remove(d / "config.json")
  with pytest.raises(DraftConfigError, match="config.json not found"):
    ckpt_lib.import_eagle3(str(d), target)
