"""Llama 4 text-model configuration: one frozen dataclass, presets, and the Hugging Face reader.

Every field of HF's `Llama4TextConfig` that changes inference is here. Derived per-layer lists
(`no_rope_layers`, `moe_layers`, `layer_types`) are always resolved, exactly as HF derives them, so the
model never re-derives anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

from maverick.quant.config import QuantConfig, QuantConfigError

CHUNKED = "chunked_attention"
FULL = "full_attention"
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
  """A config that cannot describe a valid Llama 4 text model."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """llama3-style frequency scaling (`rope_type: llama3`)."""

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class Config:
  """Llama 4 text model. Field names follow HF's `Llama4TextConfig`."""

  vocab_size: int = 202048
  hidden_size: int = 5120
  intermediate_size: int = 8192  # each routed expert and the shared expert
  intermediate_size_mlp: int = 16384  # the dense (non-MoE) MLP
  num_hidden_layers: int = 48
  num_attention_heads: int = 40
  num_key_value_heads: int = 8
  head_dim: int | None = 128
  rms_norm_eps: float = 1e-5
  tie_word_embeddings: bool = False
  num_local_experts: int = 16
  num_experts_per_tok: int = 1
  interleave_moe_layer_step: int = 1
  moe_layers: tuple[int, ...] | None = None  # None: derived from interleave_moe_layer_step
  use_qk_norm: bool = True
  rope_theta: float = 500000.0
  rope_scaling: RopeScaling | None = None
  no_rope_layer_interval: int = 4
  no_rope_layers: tuple[int, ...] | None = None  # 1 = layer uses RoPE; None: derived from the interval
  attention_chunk_size: int = 8192
  layer_types: tuple[str, ...] | None = None  # None: chunked on RoPE layers, full on NoPE layers
  attn_temperature_tuning: bool = True
  floor_scale: float = 8192.0
  attn_scale: float = 0.1
  max_position_embeddings: int = 131072
  bos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()
  pad_token_id: int | None = None
  dtype: str = "bfloat16"  # parameter and activation dtype
  quant: QuantConfig | None = None  # FP8 weights/activations/KV cache (maverick.quant); None: off

  def __post_init__(self):
    L = self.num_hidden_layers
    set_ = lambda k, v: object.__setattr__(self, k, v)
    # Type checks first, so a null or string field is reported by name (not as a TypeError).
    for name in ("num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size",
                 "intermediate_size_mlp", "num_attention_heads", "num_key_value_heads",
                 "num_local_experts", "num_experts_per_tok", "interleave_moe_layer_step",
                 "attention_chunk_size", "no_rope_layer_interval"):
      _require(_is_int(getattr(self, name)) and getattr(self, name) >= 1,
               f"{name} must be a positive integer, got {getattr(self, name)!r}")
    _require(self.head_dim is None or (_is_int(self.head_dim) and self.head_dim >= 1),
             f"head_dim must be a positive integer or null, got {self.head_dim!r}")
    for name in ("rms_norm_eps", "rope_theta", "floor_scale", "attn_scale"):
      _require(_is_num(getattr(self, name)),
               f"{name} must be a number, got {getattr(self, name)!r}")
    if self.head_dim is None:
      _require(self.hidden_size % self.num_attention_heads == 0,
               f"head_dim is null and hidden_size {self.hidden_size} is not divisible by "
               f"num_attention_heads {self.num_attention_heads}; set head_dim explicitly")
      set_("head_dim", self.hidden_size // self.num_attention_heads)
    _require(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
    _require(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads {self.num_attention_heads} must be a multiple of "
             f"num_key_value_heads {self.num_key_value_heads}")
    _require(self.num_experts_per_tok <= self.num_local_experts,
             f"num_experts_per_tok {self.num_experts_per_tok} > num_local_experts "
             f"{self.num_local_experts}")
    _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
    _require(self.quant is None or isinstance(self.quant, QuantConfig),
             f"quant must be a maverick.quant.QuantConfig or None, got {self.quant!r}")
    _require(self.rope_theta > 0, f"rope_theta must be positive, got {self.rope_theta}")
    _require(self.floor_scale > 0, f"floor_scale must be positive, got {self.floor_scale}")

    # HF: `no_rope_layers or [...]`, so an empty list also means "derive from the interval".
    if not self.no_rope_layers:
      set_("no_rope_layers",
           tuple(int((i + 1) % self.no_rope_layer_interval != 0) for i in range(L)))
    set_("no_rope_layers", _int_tuple("no_rope_layers", self.no_rope_layers))
    _require(len(self.no_rope_layers) == L,
             f"no_rope_layers has {len(self.no_rope_layers)} entries but num_hidden_layers is {L}")
    _require(set(self.no_rope_layers) <= {0, 1}, "no_rope_layers entries must be 0 or 1")

    if self.moe_layers is None:
      step = self.interleave_moe_layer_step
      set_("moe_layers", tuple(range(step - 1, L, step)))
    set_("moe_layers", tuple(sorted(_int_tuple("moe_layers", self.moe_layers))))
    _require(len(set(self.moe_layers)) == len(self.moe_layers),
             f"moe_layers has duplicates: {self.moe_layers}")
    _require(all(0 <= i < L for i in self.moe_layers),
             f"moe_layers {self.moe_layers} has indices outside 0..{L - 1}")

    if not self.layer_types:
      set_("layer_types", tuple(CHUNKED if r else FULL for r in self.no_rope_layers))
    set_("layer_types", tuple(self.layer_types))
    _require(len(self.layer_types) == L,
             f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {L}")
    bad = sorted(set(self.layer_types) - {CHUNKED, FULL})
    _require(not bad, f"unknown layer_types {bad}; expected {CHUNKED!r} or {FULL!r}")
    set_("eos_token_ids", _int_tuple("eos_token_ids", self.eos_token_ids))
    if self.rope_scaling is not None:
      rs = self.rope_scaling
      _require(rs.factor > 0 and rs.original_max_position_embeddings > 0,
               "rope_scaling factor and original_max_position_embeddings must be positive")
      _require(rs.high_freq_factor >= rs.low_freq_factor,
               f"rope_scaling high_freq_factor {rs.high_freq_factor} < low_freq_factor "
               f"{rs.low_freq_factor}")

  # Per-layer roles, the only way the model reads the layer lists.
  def uses_rope(self, layer: int) -> bool:
    return bool(self.no_rope_layers[layer])

  def is_moe(self, layer: int) -> bool:
    return layer in self.moe_layers

  def is_chunked(self, layer: int) -> bool:
    return self.layer_types[layer] == CHUNKED

  @property
  def q_per_kv(self) -> int:
    return self.num_attention_heads // self.num_key_value_heads

  def replace(self, **changes) -> "Config":
    return dataclasses.replace(self, **changes)

  # --- our own serialisation (saved next to converted checkpoints) ---
  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["rope_scaling"] = None if self.rope_scaling is None else dataclasses.asdict(self.rope_scaling)
    d["quant"] = None if self.quant is None else self.quant.to_dict()
    for k in ("moe_layers", "no_rope_layers", "layer_types", "eos_token_ids"):
      d[k] = list(d[k])
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Config":
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    _require(not unknown, f"unknown config fields {unknown}")
    d = dict(d)
    if d.get("rope_scaling") is not None:
      d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
    if d.get("quant") is not None:
      try:
        d["quant"] = QuantConfig.from_dict(d["quant"])
      except (QuantConfigError, TypeError) as e:
        raise ConfigError(f"quant: {e}") from None
    for k in ("moe_layers", "no_rope_layers", "layer_types", "eos_token_ids"):
      if d.get(k) is not None:
        d[k] = tuple(d[k])
    return cls(**d)


def _require(cond: bool, msg: str):
  if not cond:
    raise ConfigError(msg)


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_tuple(name: str, values) -> tuple[int, ...]:
  """Integer entries (JSON may give 3.0), anything else is an error naming the field."""
  try:
    values = tuple(values)
  except TypeError:
    raise ConfigError(f"{name} must be a list of integers, got {values!r}") from None
  out = []
  for v in values:
    _require(_is_num(v) and float(v).is_integer(),
             f"{name} must be a list of integers, got entry {v!r}")
    out.append(int(v))
  return tuple(out)


# ----------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------
_LLAMA4_SPECIAL = dict(bos_token_id=200000, eos_token_ids=(200001, 200007, 200008),
                       pad_token_id=200018)


def scout() -> Config:
  """Llama-4-Scout-17B-16E (published config.json values)."""
  return Config(
      num_local_experts=16, interleave_moe_layer_step=1, use_qk_norm=True,
      rope_scaling=RopeScaling(16.0, 1.0, 1.0, 8192), max_position_embeddings=10485760,
      **_LLAMA4_SPECIAL)


def maverick() -> Config:
  """Llama-4-Maverick-17B-128E (published config.json values)."""
  return Config(
      num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False, rope_scaling=None,
      max_position_embeddings=1048576, **_LLAMA4_SPECIAL)


def tiny(dtype: str = "float32") -> Config:
  """Small model with every Llama 4 feature on (the shape of the HF test fixture)."""
  return Config(
      vocab_size=512, hidden_size=64, intermediate_size=48, intermediate_size_mlp=96,
      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
      num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2,
      attention_chunk_size=16, no_rope_layer_interval=4, attn_temperature_tuning=True,
      floor_scale=8.0, attn_scale=0.25, use_qk_norm=True,
      rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32), max_position_embeddings=4096, dtype=dtype)


def tiny_top2_tied(dtype: str = "float32") -> Config:
  """Features the HF fixture leaves out: top-2 routing, tied embeddings, MoE on every layer,
  NoPE every 3rd layer, no QK norm, no temperature tuning, plain RoPE."""
  return Config(
      vocab_size=384, hidden_size=48, intermediate_size=32, intermediate_size_mlp=64,
      num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
      num_local_experts=6, num_experts_per_tok=2, interleave_moe_layer_step=1,
      tie_word_embeddings=True, attention_chunk_size=8, no_rope_layer_interval=3,
      attn_temperature_tuning=False, use_qk_norm=False, rope_scaling=None,
      max_position_embeddings=2048, dtype=dtype)


PRESETS = {"maverick": maverick, "scout": scout, "tiny": tiny, "tiny_top2_tied": tiny_top2_tied}


def preset(name: str, **overrides) -> Config:
  if name not in PRESETS:
    raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
  return PRESETS[name]().replace(**overrides)


# ----------------------------------------------------------------------------------------------
# Hugging Face config.json
# ----------------------------------------------------------------------------------------------
def from_hf(source: str | os.PathLike | Mapping[str, Any], dtype: str | None = None) -> Config:
  """Reads a HF Llama 4 `config.json` (multimodal `llama4` or text-only `llama4_text`).

  `source` is a config.json path, a checkpoint directory holding one, or the parsed dict. Token ids
  missing from config.json are taken from `generation_config.json` beside it when present.
  """
  gen_cfg: dict[str, Any] = {}
  where = "config dict"
  if isinstance(source, Mapping):
    raw = dict(source)
  else:
    path = os.fspath(source)
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    where = path
    if not os.path.isfile(path):
      raise ConfigError(f"{path} not found: a HF checkpoint directory needs config.json")
    try:
      with open(path) as f:
        raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise ConfigError(f"{path} is not valid JSON ({e}); re-download or fix the file") from None
    gen_path = os.path.join(os.path.dirname(path), "generation_config.json")
    if os.path.isfile(gen_path):
      try:
        with open(gen_path) as f:
          gen_cfg = json.load(f)
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{gen_path} is not valid JSON ({e})") from None
  if not isinstance(raw, dict):
    raise ConfigError(f"{where}: expected a JSON object at the top level")

  model_type = raw.get("model_type")
  if model_type == "llama4" or "text_config" in raw:
    text = raw.get("text_config")
    if not isinstance(text, dict):
      raise ConfigError(f"{where}: model_type 'llama4' needs a 'text_config' object")
  elif model_type in ("llama4_text", None):
    text = raw
  else:
    raise ConfigError(f"{where}: model_type {model_type!r} is not a Llama 4 model "
                      "(expected 'llama4' or 'llama4_text')")

  def get(key, default=None):
    return text.get(key, default)

  required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
  missing = [k for k in required if k not in text]
  if missing:
    raise ConfigError(f"{where}: missing required field(s) {missing}")
  act = get("hidden_act", "silu")
  if act != "silu":
    raise ConfigError(f"{where}: hidden_act {act!r} is not supported (Llama 4 uses 'silu')")
  if get("attention_bias", False):
    raise ConfigError(f"{where}: attention_bias=true is not supported (Llama 4 has no biases)")

  theta, scaling = _read_rope(text, where)
  eos = get("eos_token_id", gen_cfg.get("eos_token_id"))
  if eos is None:
    eos = gen_cfg.get("eos_token_id")
  eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
  bos = get("bos_token_id")
  bos = gen_cfg.get("bos_token_id") if bos is None else bos
  pad = get("pad_token_id")
  pad = gen_cfg.get("pad_token_id") if pad is None else pad

  tuning = get("attn_temperature_tuning", True)
  if not isinstance(tuning, (bool, int)):
    raise ConfigError(f"{where}: attn_temperature_tuning must be a bool or int, got {tuning!r}")
  hf_dtype = get("dtype", get("torch_dtype", raw.get("dtype", raw.get("torch_dtype", "bfloat16"))))
  if dtype is None:
    dtype = hf_dtype if hf_dtype in DTYPES else "bfloat16"

  def num(key, default):
    v = _rope_num(text, key, where)
    return default if v is None else v

  def flag(key, default):
    # bool("false") would be True: only JSON booleans (and 0/1) are accepted.
    v = get(key, default)
    if not isinstance(v, (bool, int)):
      raise ConfigError(f"{where}: {key} must be true or false, got {v!r}")
    return bool(v)

  def ints(key):
    v = get(key)
    if v is None:
      return None
    if not isinstance(v, list):
      raise ConfigError(f"{where}: {key} must be a list, got {type(v).__name__}")
    return tuple(v)

  try:
    return Config(
        vocab_size=get("vocab_size"), hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size", 8192),
        intermediate_size_mlp=get("intermediate_size_mlp", 16384),
        num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=get("num_attention_heads"),
        # HF's Llama4TextConfig defaults when the key is absent: 8 kv heads, head_dim 128 (an
        # explicit null head_dim means hidden_size // num_attention_heads, see Config).
        num_key_value_heads=get("num_key_value_heads", 8),
        head_dim=get("head_dim", 128), rms_norm_eps=num("rms_norm_eps", 1e-5),
        tie_word_embeddings=flag("tie_word_embeddings", False),
        num_local_experts=get("num_local_experts", 16),
        num_experts_per_tok=get("num_experts_per_tok", 1),
        interleave_moe_layer_step=get("interleave_moe_layer_step", 1),
        moe_layers=ints("moe_layers"), use_qk_norm=flag("use_qk_norm", True),
        rope_theta=theta, rope_scaling=scaling,
        no_rope_layer_interval=get("no_rope_layer_interval", 4),
        no_rope_layers=ints("no_rope_layers"),
        attention_chunk_size=_chunk_size(get("attention_chunk_size", 8192), where),
        layer_types=ints("layer_types"), attn_temperature_tuning=bool(tuning),
        floor_scale=num("floor_scale", 8192.0), attn_scale=num("attn_scale", 0.1),
        max_position_embeddings=get("max_position_embeddings", 131072),
        bos_token_id=bos, eos_token_ids=eos_ids, pad_token_id=pad, dtype=dtype)
  except ConfigError as e:
    raise ConfigError(f"{where}: {e}") from None
  except TypeError as e:
    raise ConfigError(f"{where}: a field has the wrong type ({e})") from None


def _chunk_size(v, where):
  if v is None:
    raise ConfigError(f"{where}: attention_chunk_size is null; Llama 4 needs a chunk size "
                      "(HF 5.23 also rejects this)")
  return v


def _read_rope(text: Mapping[str, Any], where: str) -> tuple[float, RopeScaling | None]:
  """`rope_parameters` (new) first, then legacy `rope_theta` + `rope_scaling`."""
  params = text.get("rope_parameters")
  legacy_theta = _rope_num(text, "rope_theta", where)
  legacy_scaling = text.get("rope_scaling")
  if legacy_scaling is not None and not isinstance(legacy_scaling, dict):
    raise ConfigError(f"{where}: rope_scaling must be an object or null, got {legacy_scaling!r}")
  if params:
    if not isinstance(params, dict):
      raise ConfigError(f"{where}: rope_parameters must be an object")
    theta = _rope_num(params, "rope_theta", where, "rope_parameters.")
    theta = legacy_theta if theta is None else theta
    if legacy_theta is not None and theta is not None and not math.isclose(theta, legacy_theta):
      raise ConfigError(f"{where}: rope_parameters.rope_theta={theta} contradicts "
                        f"rope_theta={legacy_theta}; remove one")
    if legacy_scaling and (legacy_scaling.get("rope_type", legacy_scaling.get("type"))
                           != params.get("rope_type", "default")):
      raise ConfigError(f"{where}: rope_scaling and rope_parameters name different rope types; "
                        "remove the legacy rope_scaling")
    scaling_src = params
  else:
    theta = legacy_theta
    scaling_src = legacy_scaling or {}
  theta = 500000.0 if theta is None else float(theta)
  rope_type = scaling_src.get("rope_type", scaling_src.get("type", "default"))
  if rope_type == "default":
    return theta, None
  if rope_type != "llama3":
    raise ConfigError(f"{where}: rope_type {rope_type!r} is not supported "
                      "(Llama 4 uses 'default' or 'llama3')")
  factor = _rope_num(scaling_src, "factor", where, "rope scaling ")
  if factor is None:
    raise ConfigError(f"{where}: llama3 rope scaling needs 'factor'")
  old = _rope_num(scaling_src, "original_max_position_embeddings", where, "rope scaling ")
  if old is None:  # HF standardize_rope_params: defaults to max_position_embeddings
    old = text.get("max_position_embeddings", 131072)
  lo = _rope_num(scaling_src, "low_freq_factor", where, "rope scaling ")
  hi = _rope_num(scaling_src, "high_freq_factor", where, "rope scaling ")
  return theta, RopeScaling(
      factor=factor, low_freq_factor=1.0 if lo is None else lo,
      high_freq_factor=4.0 if hi is None else hi, original_max_position_embeddings=int(old))


def _rope_num(d: Mapping[str, Any], key: str, where: str, prefix: str = "") -> float | None:
  v = d.get(key)
  if v is not None and not _is_num(v):
    raise ConfigError(f"{where}: {prefix}{key} must be a number, got {v!r}")
  return None if v is None else float(v)
