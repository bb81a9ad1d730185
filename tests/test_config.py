"""Config: HF config.json reading (derivations, legacy forms, errors), presets, serialisation."""

import json
import math

import numpy as np
import pytest

from maverick import config as config_lib
from maverick.config import CHUNKED, FULL, Config, ConfigError, RopeScaling


def _text(**overrides):
  """A minimal valid llama4_text config dict: only interval/step, no explicit lists."""
  d = {"model_type": "llama4_text", "vocab_size": 512, "hidden_size": 64,
       "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 32, "intermediate_size": 48, "intermediate_size_mlp": 96,
       "num_local_experts": 8, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
       "no_rope_layer_interval": 4, "attention_chunk_size": 16, "dtype": "float32"}
  d.update(overrides)
  return {k: v for k, v in d.items() if v is not _DROP}


_DROP = object()


def _write(tmp_path, d):
  path = tmp_path / "config.json"
  path.write_text(json.dumps(d))
  return path


def _hf_derive(L, interval, step):
  """HF Llama4TextConfig.__post_init__, written out independently."""
  no_rope = [int((i + 1) % interval != 0) for i in range(L)]
  moe = list(range(step - 1, L, step))
  types = ["chunked_attention" if r else "full_attention" for r in no_rope]
  return no_rope, moe, types


# ----------------------------------------------------------------------------------------------
# from_hf: the fixture and derivations
# ----------------------------------------------------------------------------------------------
def test_from_hf_fixture_matches_meta(hf_fixture_dir):
  cfg = config_lib.from_hf(hf_fixture_dir)
  meta = json.loads((hf_fixture_dir / "meta.json").read_text())["derived"]
  assert [i for i in range(cfg.num_hidden_layers) if not cfg.uses_rope(i)] == meta["nope_layers"]
  assert [i for i in range(8) if not cfg.uses_rope(i)] == [3, 7]
  assert list(cfg.moe_layers) == meta["moe_layers"] == [1, 3, 5, 7]
  assert [i for i in range(8) if not cfg.is_moe(i)] == meta["dense_layers"]
  assert list(cfg.layer_types) == meta["layer_types"]
  assert cfg.head_dim == 32 and cfg.hidden_size // cfg.num_attention_heads == 16
  assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)
  assert cfg.attn_temperature_tuning and cfg.use_qk_norm and not cfg.tie_word_embeddings
  assert (cfg.floor_scale, cfg.attn_scale, cfg.dtype) == (8.0, 0.25, "float32")
  # The same config through the dict path and the explicit file path.
  raw = json.loads((hf_fixture_dir / "config.json").read_text())
  assert config_lib.from_hf(raw) == cfg
  assert config_lib.from_hf(hf_fixture_dir / "config.json") == cfg


def test_fixture_rope_inv_freq(hf_fixture_dir, hf_fixture):
  from maverick.model import rope_inv_freq
  got = rope_inv_freq(config_lib.from_hf(hf_fixture_dir))
  np.testing.assert_allclose(got, hf_fixture["rope_inv_freq"], rtol=1e-6)


@pytest.mark.parametrize("L,interval,step", [(8, 4, 2), (12, 4, 1), (7, 3, 3), (48, 4, 2),
                                             (5, 2, 4), (6, 7, 1)])
def test_derived_lists_match_hf(L, interval, step):
  cfg = config_lib.from_hf(_text(num_hidden_layers=L, no_rope_layer_interval=interval,
                                 interleave_moe_layer_step=step))
  no_rope, moe, types = _hf_derive(L, interval, step)
  assert list(cfg.no_rope_layers) == no_rope
  assert list(cfg.moe_layers) == moe
  assert list(cfg.layer_types) == types
  assert [cfg.is_chunked(i) for i in range(L)] == [bool(r) for r in no_rope]


def test_empty_no_rope_layers_derives_from_interval():
  cfg = config_lib.from_hf(_text(no_rope_layers=[], no_rope_layer_interval=3))
  assert list(cfg.no_rope_layers) == _hf_derive(8, 3, 2)[0]
  assert [i for i in range(8) if not cfg.uses_rope(i)] == [2, 5]


def test_explicit_lists_override_interval_and_step():
  cfg = config_lib.from_hf(_text(no_rope_layers=[0, 1, 1, 1, 1, 1, 1, 1], moe_layers=[0, 6],
                                 layer_types=[FULL] * 8))
  assert cfg.no_rope_layers == (0,) + (1,) * 7
  assert cfg.moe_layers == (0, 6)
  assert cfg.layer_types == (FULL,) * 8
  # HF: an empty moe_layers list is kept as "no MoE layers" (only None derives).
  assert config_lib.from_hf(_text(moe_layers=[])).moe_layers == ()


# ----------------------------------------------------------------------------------------------
# from_hf: legacy forms, multimodal, int temperature tuning
# ----------------------------------------------------------------------------------------------
_LLAMA3 = {"factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
           "original_max_position_embeddings": 8192}


def test_legacy_rope_scaling_llama3_equals_rope_parameters():
  new = config_lib.from_hf(_text(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                                                  **_LLAMA3}))
  legacy = config_lib.from_hf(_text(rope_theta=5e5, rope_scaling={"rope_type": "llama3",
                                                                  **_LLAMA3}))
  # Very old configs spell it "type".
  older = config_lib.from_hf(_text(rope_theta=5e5, rope_scaling={"type": "llama3", **_LLAMA3}))
  assert new == legacy == older
  assert new.rope_scaling == RopeScaling(16.0, 1.0, 1.0, 8192)
  assert new.rope_theta == 5e5


def test_legacy_rope_scaling_null_equals_default_rope_parameters():
  new = config_lib.from_hf(_text(rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
  legacy = config_lib.from_hf(_text(rope_theta=1e4, rope_scaling=None))
  assert new == legacy
  assert new.rope_scaling is None and new.rope_theta == 1e4
  # Both present and agreeing is fine (HF 5.x keeps rope_theta next to rope_parameters).
  both = config_lib.from_hf(_text(rope_theta=1e4, rope_scaling=None,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
  assert both == new


def test_llama3_original_max_position_defaults_to_max_position_embeddings():
  scaling = {k: v for k, v in _LLAMA3.items() if k != "original_max_position_embeddings"}
  cfg = config_lib.from_hf(_text(max_position_embeddings=4096,
                                 rope_parameters={"rope_type": "llama3", **scaling}))
  assert cfg.rope_scaling.original_max_position_embeddings == 4096


def test_multimodal_config_reads_text_config(tmp_path):
  text = _text(model_type="llama4_text", moe_layers=[1, 3, 5, 7])
  mm = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
        "tie_word_embeddings": False, "text_config": text,
        "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 1408}}
  cfg = config_lib.from_hf(_write(tmp_path, mm))
  assert cfg == config_lib.from_hf(text)
  assert cfg.moe_layers == (1, 3, 5, 7) and cfg.vocab_size == 512


def test_generation_config_supplies_token_ids(tmp_path):
  _write(tmp_path, _text())
  (tmp_path / "generation_config.json").write_text(json.dumps(
      {"bos_token_id": 200000, "eos_token_id": [200001, 200007], "pad_token_id": 200018}))
  cfg = config_lib.from_hf(tmp_path)
  assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (200000, (200001, 200007),
                                                                     200018)
  # config.json wins where it has a value.
  _write(tmp_path, _text(eos_token_id=7))
  assert config_lib.from_hf(tmp_path).eos_token_ids == (7,)


@pytest.mark.parametrize("value,expected", [(4, True), (0, False), (True, True), (False, False)])
def test_attn_temperature_tuning_int_or_bool(value, expected):
  cfg = config_lib.from_hf(_text(attn_temperature_tuning=value))
  assert cfg.attn_temperature_tuning is expected


def test_dtype_from_config_and_override():
  assert config_lib.from_hf(_text(dtype="bfloat16")).dtype == "bfloat16"
  assert config_lib.from_hf(_text(dtype=_DROP, torch_dtype="float16")).dtype == "float16"
  assert config_lib.from_hf(_text(dtype="bfloat16"), dtype="float32").dtype == "float32"


def test_head_dim_null_is_hidden_over_heads():
  assert config_lib.from_hf(_text(head_dim=None)).head_dim == 16


def test_omitted_head_dim_and_kv_heads_take_hf_defaults():
  """Absent keys take Llama4TextConfig's defaults (head_dim 128, 8 kv heads), not H / n_heads and
  n_heads (a config written without them would otherwise build another model)."""
  cfg = config_lib.from_hf(_text(head_dim=_DROP, num_key_value_heads=_DROP, num_attention_heads=16,
                                 hidden_size=256))
  assert (cfg.head_dim, cfg.num_key_value_heads) == (128, 8)


# ----------------------------------------------------------------------------------------------
# from_hf: errors name the problem
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,words", [
    (dict(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
     ["rope_theta", "contradicts"]),
    (dict(no_rope_layers=[1, 1, 0]), ["no_rope_layers", "3 entries"]),
    (dict(layer_types=[CHUNKED] * 5), ["layer_types", "5 entries"]),
    (dict(layer_types=["sliding_attention"] * 8), ["layer_types", "sliding_attention"]),
    (dict(moe_layers=[1, 8]), ["moe_layers", "outside"]),
    (dict(moe_layers=[-1]), ["moe_layers", "outside"]),
    (dict(moe_layers=[1, "a"]), ["moe_layers", "'a'"]),
    (dict(moe_layers=3), ["moe_layers", "list"]),
    (dict(no_rope_layers=[2] * 8), ["no_rope_layers", "0 or 1"]),
    (dict(num_attention_heads=5, num_key_value_heads=2, head_dim=32),
     ["num_attention_heads", "num_key_value_heads"]),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), ["rope_type", "yarn"]),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), ["rope_type", "dynamic"]),
    (dict(rope_parameters={"rope_type": "llama3"}), ["factor"]),
    (dict(rope_parameters={"rope_type": "llama3", **_LLAMA3, "factor": "16"}), ["factor"]),
    (dict(rope_theta="big"), ["rope_theta"]),
    (dict(hidden_act="gelu"), ["hidden_act", "gelu"]),
    (dict(attention_chunk_size=None), ["attention_chunk_size"]),
    (dict(attention_bias=True), ["attention_bias"]),
    (dict(attn_temperature_tuning="yes"), ["attn_temperature_tuning"]),
    (dict(use_qk_norm="false"), ["use_qk_norm"]),
    (dict(num_hidden_layers=None), ["num_hidden_layers"]),
    (dict(hidden_size="64"), ["hidden_size"]),
    (dict(num_experts_per_tok=9), ["num_experts_per_tok"]),
    (dict(head_dim=31), ["head_dim"]),
    (dict(vocab_size=_DROP), ["missing", "vocab_size"]),
    (dict(num_hidden_layers=_DROP), ["missing", "num_hidden_layers"]),
    (dict(model_type="llama"), ["model_type", "llama"]),
    (dict(rms_norm_eps="tiny"), ["rms_norm_eps"]),
])
def test_bad_config_raises_naming_the_field(overrides, words):
  with pytest.raises(ConfigError) as e:
    config_lib.from_hf(_text(**overrides))
  for w in words:
    assert w in str(e.value), (w, str(e.value))


def test_multimodal_without_text_config():
  with pytest.raises(ConfigError, match="text_config"):
    config_lib.from_hf({"model_type": "llama4", "vision_config": {}})


def test_malformed_json_names_the_file(tmp_path):
  path = tmp_path / "config.json"
  path.write_text('{"vocab_size": 512,,}')
  with pytest.raises(ConfigError) as e:
    config_lib.from_hf(tmp_path)
  assert str(path) in str(e.value) and "JSON" in str(e.value)
  path.write_bytes(b"\xff\xfe\x00garbage")
  with pytest.raises(ConfigError, match="config.json"):
    config_lib.from_hf(path)


def test_missing_config_json(tmp_path):
  with pytest.raises(ConfigError) as e:
    config_lib.from_hf(tmp_path)
  assert "config.json" in str(e.value) and "not found" in str(e.value)


def test_error_names_the_file_it_came_from(tmp_path):
  path = _write(tmp_path, _text(moe_layers=[9]))
  with pytest.raises(ConfigError) as e:
    config_lib.from_hf(path)
  assert str(path) in str(e.value) and "moe_layers" in str(e.value)


# ----------------------------------------------------------------------------------------------
# Presets (spec §7) and serialisation
# ----------------------------------------------------------------------------------------------
def _common_published(cfg):
  assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
          cfg.num_key_value_heads, cfg.head_dim) == (5120, 48, 40, 8, 128)
  assert (cfg.vocab_size, cfg.intermediate_size, cfg.intermediate_size_mlp) == (202048, 8192,
                                                                               16384)
  assert cfg.num_experts_per_tok == 1 and cfg.rope_theta == 500000.0
  assert cfg.attention_chunk_size == 8192 and cfg.rms_norm_eps == 1e-5
  assert cfg.attn_temperature_tuning and (cfg.floor_scale, cfg.attn_scale) == (8192.0, 0.1)
  assert [i for i in range(48) if not cfg.uses_rope(i)] == list(range(3, 48, 4))
  assert [cfg.layer_types[i] for i in range(3, 48, 4)] == [FULL] * 12
  assert sum(cfg.is_chunked(i) for i in range(48)) == 36
  assert not cfg.tie_word_embeddings and cfg.dtype == "bfloat16"
  assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (
      200000, (200001, 200007, 200008), 200018)


def test_maverick_preset():
  cfg = config_lib.maverick()
  _common_published(cfg)
  assert cfg.num_local_experts == 128 and cfg.interleave_moe_layer_step == 2
  assert cfg.moe_layers == tuple(range(1, 48, 2))
  assert [i for i in range(48) if not cfg.is_moe(i)] == list(range(0, 48, 2))
  assert not cfg.use_qk_norm and cfg.rope_scaling is None
  assert cfg.max_position_embeddings == 1048576
  # Every NoPE layer of Maverick is a MoE layer (spec §7).
  assert all(cfg.is_moe(i) for i in range(3, 48, 4))


def test_scout_preset():
  cfg = config_lib.scout()
  _common_published(cfg)
  assert cfg.num_local_experts == 16 and cfg.moe_layers == tuple(range(48))
  assert cfg.use_qk_norm
  assert cfg.rope_scaling == RopeScaling(factor=16.0, low_freq_factor=1.0, high_freq_factor=1.0,
                                         original_max_position_embeddings=8192)
  assert cfg.max_position_embeddings == 10485760


def test_preset_lookup():
  assert config_lib.preset("scout") == config_lib.scout()
  assert config_lib.preset("maverick", dtype="float32").dtype == "float32"
  with pytest.raises(ConfigError, match="unknown preset"):
    config_lib.preset("llama5")


@pytest.mark.parametrize("name", sorted(config_lib.PRESETS))
def test_to_dict_from_dict_round_trip(name):
  cfg = config_lib.preset(name)
  d = cfg.to_dict()
  # Must survive JSON (our checkpoints store it in maverick.json).
  back = Config.from_dict(json.loads(json.dumps(d)))
  assert back == cfg
  assert back.to_dict() == d


def test_from_dict_rejects_unknown_fields():
  d = config_lib.tiny().to_dict()
  d["num_experts"] = 3
  with pytest.raises(ConfigError, match="num_experts"):
    Config.from_dict(d)


def test_scout_rope_inv_freq_llama3_with_equal_factors():
  """Spec §3.3: low == high factor; 35..63 divided by 16, 0..34 unchanged, no NaN (no 0/0)."""
  from maverick.model import rope_inv_freq
  cfg = config_lib.scout()
  got = rope_inv_freq(cfg)
  assert got.dtype == np.float32 and got.shape == (64,)
  assert np.all(np.isfinite(got))
  base = 1.0 / (500000.0 ** (np.arange(0, 128, 2, dtype=np.float64) / 128))
  wavelen = 2 * math.pi / base
  # Check the spec's band boundary itself, then the model against it.
  assert np.all(wavelen[35:] > 8192) and np.all(wavelen[:35] < 8192)
  expected = np.where(np.arange(64) >= 35, base / 16.0, base)
  np.testing.assert_allclose(got, expected, rtol=2e-6)
  np.testing.assert_allclose(got[:35], base[:35], rtol=2e-6)
  np.testing.assert_allclose(got[35:] * 16.0, base[35:], rtol=2e-6)


def test_maverick_rope_inv_freq_is_plain():
  from maverick.model import rope_inv_freq
  base = 1.0 / (500000.0 ** (np.arange(0, 128, 2, dtype=np.float64) / 128))
  np.testing.assert_allclose(rope_inv_freq(config_lib.maverick()), base, rtol=2e-6)
