"""EAGLE-3 draft checkpoints: our native orbax format, and the HF EAGLE-3 ("midlayer") layout.

Native layout (what we ship):
  eagle3.json   {"format": "maverick-eagle3/1", "config": Eagle3Config.to_dict()}
  params/       one orbax checkpoint of the whole draft state (weights and the d2t map)

EAGLE-3 layout (nvidia/Llama-4-Maverick-17B-128E-Eagle3, SpecForge, SafeAILab/EAGLE): a Llama
`config.json` plus `model.safetensors` (or shards with an index) holding `fc.weight`,
`midlayer.*` (or `layers.0.*`), `norm.weight`, `lm_head.weight`, and `d2t`/`t2d` for a reduced
vocabulary. Spec: /work/shared/research/eagle3_spec.md section 2. Config flags, NVIDIA's
hf_quant_config.json and the sources each fact was confirmed from: spec_decode/nvidia_eagle3.py.

RoPE layout: EAGLE-3 layers are HF Llama layers, which rotate the pairs (i, i + Dh/2)
(rotate_half); our Attention rotates the pairs (2i, 2i+1) with the same inv_freq[i]. Import
permutes the head dim of q and k (not v) so each HF pair becomes one of ours; since q and k get
the same permutation, q.k and so the attention scores are unchanged and the draft is exact.

Every write goes to a temporary sibling directory renamed into place on success, so a failed
save or export leaves no output directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import struct
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from maverick import config as config_lib
from maverick import sharding as sharding_lib
from maverick.checkpoint import hf, store
from maverick.checkpoint.hf import CheckpointError, SafetensorsCheckpoint
from maverick.config import Config, ConfigError
from spec_decode import nvidia_eagle3
from spec_decode.draft import (
  DraftConfigError,
  Eagle3Config,
  Eagle3Draft,
  abstract_draft,
  default_aux_layers,
)

FORMAT = "maverick-eagle3/1"
META_FILE = "eagle3.json"
PARAMS_DIR = "params"
HF_CONFIG = "config.json"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
# EAGLE-3 checkpoints do not set rope_theta (EAGLE's training ignores it): HF Llama's default.
DEFAULT_ROPE_THETA = 10000.0
_LAYER_ALIASES = ("layers.0.",)  # speculators / vLLM name for `midlayer.`
# Integer and bool tensors (d2t, t2d); float weights are read by SafetensorsCheckpoint.read.
_OTHER_DTYPES = {"I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "BOOL": np.dtype("u1"),
                 "U8": np.dtype("u1")}
_WRITE_CODES = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
                np.dtype(np.float16): "F16", np.dtype(np.int64): "I64",
                np.dtype(np.int32): "I32", np.dtype(np.bool_): "BOOL"}


# ----------------------------------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------------------------------
def check_d2t(d2t, target_vocab: int) -> np.ndarray:
  """Validates a d2t offset map; returns the target ids i + d2t[i] (int64).

  Raises DraftConfigError naming the first draft id that maps outside [0, target_vocab) or onto
  a target id an earlier draft id already took.
  """
  d2t = np.asarray(d2t)
  if d2t.ndim != 1 or not np.issubdtype(d2t.dtype, np.integer):
    raise DraftConfigError(f"d2t must be a 1-D integer array, got {d2t.dtype} {list(d2t.shape)}")
  ids = np.arange(d2t.shape[0], dtype=np.int64) + d2t.astype(np.int64)
  out = np.nonzero((ids < 0) | (ids >= target_vocab))[0]
  if out.size:
    i = int(out[0])
    raise DraftConfigError(
        f"d2t[{i}] = {int(d2t[i])} maps draft id {i} to target id {int(ids[i])}, outside "
        f"[0, {target_vocab}); d2t holds offsets (target id = i + d2t[i]), not absolute ids")
  _, first = np.unique(ids, return_index=True)
  dup = np.ones(ids.shape[0], bool)
  dup[first] = False
  if dup.any():
    i = int(np.nonzero(dup)[0][0])
    j = int(np.nonzero(ids == ids[i])[0][0])
    raise DraftConfigError(f"d2t[{i}] maps draft id {i} to target id {int(ids[i])}, which draft "
                           f"id {j} already maps to; target ids must be distinct")
  return ids


def _t2d_from(ids: np.ndarray, target_vocab: int) -> np.ndarray:
  t2d = np.zeros((target_vocab,), np.bool_)
  t2d[ids] = True
  return t2d


def _rope_perm(head_dim: int) -> np.ndarray:
  """ours[..., j] = hf[..., perm[j]]: HF pair (i, i + Dh/2) -> our pair (2i, 2i+1)."""
  half = head_dim // 2
  return np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)


def _write_json(path: str, obj: Mapping[str, Any]):
  with open(path, "w") as f:
    json.dump(obj, f, indent=1)


def _flat_state(draft: Eagle3Draft) -> dict[tuple[str, ...], Any]:
  _, state = nnx.split(draft)
  return {tuple(str(p) for p in path): var.get_value() for path, var in nnx.to_flat_state(state)}


def _assemble(cfg: Eagle3Config, arrays: Mapping[tuple[str, ...], Any]) -> Eagle3Draft:
  graphdef, abstract = nnx.split(abstract_draft(cfg))
  flat = []
  for path, var in nnx.to_flat_state(abstract):
    value = arrays[tuple(str(p) for p in path)]
    sds = var.get_value()
    if tuple(value.shape) != tuple(sds.shape):  # a bug here, not a user error: the plan checks
      raise AssertionError(f"{path}: {value.shape} != {sds.shape}")
    flat.append((path, var.replace(value=value)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _with_dtype(cfg: Eagle3Config, dtype: str | None) -> Eagle3Config:
  if dtype is None:
    return cfg
  try:
    return dataclasses.replace(cfg, layer=cfg.layer.replace(dtype=dtype))
  except ConfigError as e:
    raise DraftConfigError(str(e)) from None


# ----------------------------------------------------------------------------------------------
# Native format
# ----------------------------------------------------------------------------------------------
def is_native_draft(path: str) -> bool:
  return os.path.isfile(os.path.join(path, META_FILE))


def read_draft_meta(path: str) -> dict:
  return store.read_format_json(path, META_FILE, FORMAT, "a maverick EAGLE-3 draft",
                                "import an EAGLE-3 checkpoint with import_eagle3")


def save_draft(draft: Eagle3Draft, out_dir: str, *, overwrite: bool = False) -> str:
  """Saves a draft (weights and d2t) in our format; returns the absolute output path."""
  cfg = draft.config
  flat = _flat_state(draft)
  check_d2t(np.asarray(flat[("d2t",)]), cfg.target_vocab_size)  # never ship a broken map
  with store.AtomicDir(out_dir, overwrite, is_native_draft, "a maverick EAGLE-3 draft") as tmp:
    # Closed before the rename (also on failure): no orbax thread may still write into `tmp`.
    ckptr = ocp.StandardCheckpointer()
    try:
      ckptr.save(os.path.join(tmp, PARAMS_DIR), store._nest(flat))
      ckptr.wait_until_finished()
    finally:
      ckptr.close()
    _write_json(os.path.join(tmp, META_FILE), {"format": FORMAT, "config": cfg.to_dict()})
  return os.path.abspath(out_dir)


def load_draft(path: str, *, dtype: str | None = None, target_config: Config | None = None,
               mesh=None, rules: sharding_lib.Rules = sharding_lib.REPLICATED) -> Eagle3Draft:
  """Restores a draft saved by `save_draft`, straight into the shardings from `mesh`/`rules`.

  dtype: parameter dtype (default: as saved). target_config: when given, the draft is checked
  against it (Eagle3Config.check_target).
  """
  meta = read_draft_meta(path)
  try:
    cfg = Eagle3Config.from_dict(meta["config"])
  except (KeyError, TypeError, ValueError) as e:
    raise CheckpointError(f"{os.path.join(path, META_FILE)}: bad draft config ({e})") from None
  cfg = _with_dtype(cfg, dtype)
  if target_config is not None:
    cfg.check_target(target_config)
  _, abstract = nnx.split(abstract_draft(cfg))
  shardings = dict(nnx.to_flat_state(sharding_lib.state_shardings(abstract, mesh, rules)))
  target = {}
  for p, var in nnx.to_flat_state(abstract):
    sds = var.get_value()
    target[tuple(str(k) for k in p)] = jax.ShapeDtypeStruct(sds.shape, sds.dtype,
                                                             sharding=shardings[p])
  params_dir = os.path.join(path, PARAMS_DIR)
  if not os.path.isdir(params_dir):
    raise CheckpointError(f"{params_dir} is missing; the draft checkpoint is incomplete")
  ckptr = ocp.StandardCheckpointer()
  try:
    restored = store._flatten(ckptr.restore(params_dir, store._nest(target)))
  except (ValueError, KeyError, FileNotFoundError) as e:
    raise CheckpointError(f"{params_dir}: cannot restore the draft weights, they do not match "
                          f"{META_FILE} ({e})") from None
  finally:
    ckptr.close()
  check_d2t(np.asarray(restored[("d2t",)]), cfg.target_vocab_size)
  return _assemble(cfg, restored)


# ----------------------------------------------------------------------------------------------
# EAGLE-3 layout: config.json
# ----------------------------------------------------------------------------------------------
def _load_hf_config(path: str) -> tuple[dict, str]:
  where = os.path.join(path, HF_CONFIG) if os.path.isdir(path) else path
  if not os.path.isfile(where):
    raise DraftConfigError(f"{where} not found: an EAGLE-3 checkpoint directory needs "
                           f"{HF_CONFIG}")
  try:
    with open(where) as f:
      raw = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise DraftConfigError(f"{where} is not valid JSON ({e}); re-download or fix the "
                           "file") from None
  if not isinstance(raw, dict):
    raise DraftConfigError(f"{where}: expected a JSON object at the top level")
  return raw, where


def eagle3_config_from_hf(raw: Mapping[str, Any], target_config: Config, *,
                          dtype: str | None = None, where: str = "config.json") -> Eagle3Config:
  """An EAGLE-3 draft config.json (parsed) -> Eagle3Config, checked against the target."""
  eagle = raw.get("eagle_config") or {}
  norm_before_residual = nvidia_eagle3.check_flags(raw, where)  # every variant flag, or refuse
  nvidia_eagle3.check_config_quantization(raw, where)

  def get(key, default=None):
    v = raw.get(key)
    return default if v is None else v

  if get("hidden_act", "silu") != "silu":
    raise DraftConfigError(f"{where}: hidden_act {raw['hidden_act']!r} is not supported "
                           "(EAGLE-3 uses 'silu')")
  if get("num_hidden_layers", 1) != 1:
    raise DraftConfigError(f"{where}: num_hidden_layers={raw['num_hidden_layers']}; only "
                           "single-layer EAGLE-3 drafts are supported")
  missing = [k for k in ("hidden_size", "num_attention_heads", "vocab_size") if k not in raw]
  if missing:
    raise DraftConfigError(f"{where}: missing required field(s) {missing}")
  for key in ("draft_vocab_size", "target_hidden_size"):  # Eagle3Config does not type-check them
    v = raw.get(key)
    if v is not None and not config_lib._is_int(v):
      raise DraftConfigError(f"{where}: {key} must be an integer, got {v!r}")
  # TRT-LLM: a llama4_text draft's dense MLP width is intermediate_size_mlp (spec 2.2).
  ffn_key = "intermediate_size"
  if raw.get("model_type") == "llama4_text" and raw.get("intermediate_size_mlp") is not None:
    ffn_key = "intermediate_size_mlp"
  if raw.get(ffn_key) is None:
    raise DraftConfigError(f"{where}: missing required field {ffn_key!r}")
  ffn = raw[ffn_key]

  rope_src = dict(raw)
  params = raw.get("rope_parameters")
  if raw.get("rope_theta") is None and not (isinstance(params, dict)
                                            and params.get("rope_theta") is not None):
    rope_src["rope_theta"] = DEFAULT_ROPE_THETA  # _read_rope would default to Llama 4's 500000
  aux = eagle.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
  if aux is None:
    aux = default_aux_layers(target_config.num_hidden_layers)
  elif not (isinstance(aux, list)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in aux)):
    raise DraftConfigError(f"{where}: eagle_aux_hidden_state_layer_ids must be a list of "
                           f"integers, got {aux!r}")
  elif len(set(aux)) != len(aux):
    raise DraftConfigError(f"{where}: eagle_aux_hidden_state_layer_ids {aux} repeats a layer: "
                           "EAGLE-3 fuses 3 distinct target layers; fix the draft's config.json")
  if dtype is None:
    dtype = get("torch_dtype", get("dtype"))
    dtype = dtype if dtype in config_lib.DTYPES else target_config.dtype

  try:
    theta, scaling = config_lib._read_rope(rope_src, where)  # its messages name `where`
  except ConfigError as e:
    raise DraftConfigError(str(e)) from None
  try:
    layer = Config(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=ffn,
        intermediate_size_mlp=ffn, num_hidden_layers=1,
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=get("num_key_value_heads", raw["num_attention_heads"]),
        head_dim=raw.get("head_dim"), rms_norm_eps=get("rms_norm_eps", 1e-6), moe_layers=(),
        use_qk_norm=False, rope_theta=theta, rope_scaling=scaling, no_rope_layers=(1,),
        layer_types=(config_lib.FULL,), attn_temperature_tuning=False,
        max_position_embeddings=get("max_position_embeddings",
                                    target_config.max_position_embeddings),
        dtype=dtype)
    cfg = Eagle3Config(layer=layer,
                       target_hidden_size=get("target_hidden_size", raw["hidden_size"]),
                       target_vocab_size=raw["vocab_size"],
                       draft_vocab_size=get("draft_vocab_size", raw["vocab_size"]),
                       aux_layer_ids=tuple(aux), norm_before_residual=norm_before_residual)
  except (ConfigError, DraftConfigError) as e:
    raise DraftConfigError(f"{where}: {e}") from None
  except TypeError as e:
    raise DraftConfigError(f"{where}: a field has the wrong type ({e})") from None
  try:
    cfg.check_target(target_config)
  except DraftConfigError as e:
    raise DraftConfigError(f"{where}: {e}") from None
  if list(aux) != list(cfg.aux_layer_ids):  # e.g. ModelOpt's exporter writes list(set(ids))
    logging.getLogger(__name__).warning(
        "%s: eagle_aux_hidden_state_layer_ids %s sorted to %s: the draft reads the target's "
        "features in layer order, as ModelOpt's training collects them and TensorRT-LLM reads "
        "them", where, list(aux), list(cfg.aux_layer_ids))
  return cfg


# ----------------------------------------------------------------------------------------------
# EAGLE-3 layout: tensors
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Tensor:
  shape: tuple[int, ...]
  kind: str  # "float", "int" (d2t), "bool" (t2d)
  required: bool = True


def _hf_tensors(cfg: Eagle3Config) -> dict[str, _Tensor]:
  """Canonical (midlayer.) name -> expected shape and kind."""
  lc = cfg.layer
  D, Dt, H, K, Dh = cfg.hidden_size, cfg.target_hidden_size, lc.num_attention_heads, \
      lc.num_key_value_heads, lc.head_dim
  F, V, Vd = lc.intermediate_size_mlp, cfg.target_vocab_size, cfg.draft_vocab_size
  m = "midlayer."
  return {
      "fc.weight": _Tensor((D, 3 * Dt), "float"),
      m + "hidden_norm.weight": _Tensor((D,), "float"),
      m + "input_layernorm.weight": _Tensor((D,), "float"),
      m + "self_attn.q_proj.weight": _Tensor((H * Dh, 2 * D), "float"),
      m + "self_attn.k_proj.weight": _Tensor((K * Dh, 2 * D), "float"),
      m + "self_attn.v_proj.weight": _Tensor((K * Dh, 2 * D), "float"),
      m + "self_attn.o_proj.weight": _Tensor((D, H * Dh), "float"),
      m + "post_attention_layernorm.weight": _Tensor((D,), "float"),
      m + "mlp.gate_proj.weight": _Tensor((F, D), "float"),
      m + "mlp.up_proj.weight": _Tensor((F, D), "float"),
      m + "mlp.down_proj.weight": _Tensor((D, F), "float"),
      "norm.weight": _Tensor((D,), "float"),
      "lm_head.weight": _Tensor((Vd, D), "float", required=False),
      "d2t": _Tensor((Vd,), "int", required=False),
      "t2d": _Tensor((V,), "bool", required=False),
      # The target's table, shared at run time: only its shape is checked.
      "embed_tokens.weight": _Tensor((V, D), "float", required=False),
  }


def _hf_to_ours(cfg: Eagle3Config) -> dict[str, tuple[tuple[str, ...], Callable]]:
  """Canonical name -> (our parameter path, HF array -> our array)."""
  lc = cfg.layer
  D, H, K, Dh = cfg.hidden_size, lc.num_attention_heads, lc.num_key_value_heads, lc.head_dim
  perm = _rope_perm(Dh)
  t = lambda x: np.ascontiguousarray(x.T)  # nn.Linear stores [out, in]; we store [in, out]
  ident = lambda x: x
  m = "midlayer."
  return {
      "fc.weight": (("fc",), t),
      m + "hidden_norm.weight": (("hidden_norm", "weight"), ident),
      m + "input_layernorm.weight": (("embed_norm", "weight"), ident),
      m + "self_attn.q_proj.weight": (
          ("layer", "attn", "q"), lambda x: np.ascontiguousarray(
              x.T.reshape(2 * D, H, Dh)[..., perm])),
      m + "self_attn.k_proj.weight": (
          ("layer", "attn", "k"), lambda x: np.ascontiguousarray(
              x.T.reshape(2 * D, K, Dh)[..., perm])),
      m + "self_attn.v_proj.weight": (("layer", "attn", "v"), lambda x: t(x).reshape(2 * D, K, Dh)),
      m + "self_attn.o_proj.weight": (("layer", "attn", "o"), lambda x: t(x).reshape(H, Dh, D)),
      m + "post_attention_layernorm.weight": (("layer", "post_attn_norm", "weight"), ident),
      m + "mlp.gate_proj.weight": (("layer", "ffn", "gate"), t),
      m + "mlp.up_proj.weight": (("layer", "ffn", "up"), t),
      m + "mlp.down_proj.weight": (("layer", "ffn", "down"), t),
      "norm.weight": (("final_norm", "weight"), ident),
      "lm_head.weight": (("lm_head",), t),
  }


def _canonical(name: str) -> str:
  for alias in _LAYER_ALIASES:
    if name.startswith(alias):
      return "midlayer." + name[len(alias):]
  return name


def _plan(ckpt: SafetensorsCheckpoint, cfg: Eagle3Config) -> dict[str, str]:
  """Checks names, shapes and dtypes from the headers alone; returns canonical -> stored name."""
  expected = _hf_tensors(cfg)
  found: dict[str, str] = {}
  extra = []
  for stored in ckpt.tensors:
    canonical = _canonical(stored)
    if canonical in expected:
      if canonical in found:
        raise CheckpointError(f"tensor {canonical} appears twice ({found[canonical]}, {stored})")
      found[canonical] = stored
    else:
      extra.append(stored)
  biases = sorted(n for n in extra if n.endswith(".bias"))
  if biases:
    raise CheckpointError(f"bias tensor(s) {biases} in {ckpt.directory} are not supported (the "
                          "EAGLE-3 draft has no biases; fc.bias comes from third-party variants)")
  if extra:
    more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
    raise CheckpointError(f"unexpected tensor(s) {sorted(extra)[:5]}{more} in {ckpt.directory}: "
                          "not part of a single-layer EAGLE-3 draft")
  missing = sorted(n for n, t in expected.items() if t.required and n not in found)
  if missing:
    raise CheckpointError(f"missing tensor(s) {missing} in {ckpt.directory}")
  for canonical, stored in found.items():
    info, want = ckpt.tensors[stored], expected[canonical]
    if info.shape != want.shape:
      raise CheckpointError(f"tensor {stored} has shape {list(info.shape)}, expected "
                            f"{list(want.shape)} from config.json")
    ok = {"float": tuple(hf._FLOAT_DTYPES), "int": ("I64", "I32"), "bool": ("BOOL", "U8")}
    if info.dtype not in ok[want.kind]:
      raise CheckpointError(f"tensor {stored} has dtype {info.dtype}; expected one of "
                            f"{list(ok[want.kind])}")
  return found


def _read(ckpt: SafetensorsCheckpoint, name: str) -> np.ndarray:
  """Any tensor `_plan` accepted; bool tensors come back as np.bool_."""
  info = ckpt.tensors[name]
  if info.dtype in hf._FLOAT_DTYPES:
    return ckpt.read(name)
  dtype = _OTHER_DTYPES[info.dtype]
  n = math.prod(info.shape)
  if info.end - info.begin != n * dtype.itemsize:  # _read_header size-checks floats only
    raise CheckpointError(f"tensor {name} ({info.dtype} {list(info.shape)}) spans "
                          f"{info.end - info.begin} bytes; the file is corrupt")
  arr = np.fromfile(os.path.join(ckpt.directory, info.file), dtype=dtype, count=n,
                    offset=info.begin)
  if arr.size != n:
    raise CheckpointError(f"{info.file}: tensor {name} is truncated; re-download the file")
  arr = arr.reshape(info.shape)
  return arr != 0 if info.dtype in ("BOOL", "U8") else arr.astype(np.int64)


def import_eagle3(path: str, target_config: Config, *, dtype: str | None = None,
                  target_lm_head=None) -> Eagle3Draft:
  """Loads an EAGLE-3 checkpoint directory (config.json + safetensors) as an Eagle3Draft.

  Args:
    path: directory with config.json and model.safetensors (or shards + index).
    target_config: the target model; the draft is validated against it.
    dtype: parameter dtype (default: the config's torch_dtype, else the target's).
    target_lm_head: the target's output head [D, V] (our layout; `embed.T` for tied
      embeddings), used only when the checkpoint has no lm_head.weight: the draft head is then
      its columns at the draft vocabulary's target ids.
  """
  raw, where = _load_hf_config(path)
  cfg = eagle3_config_from_hf(raw, target_config, dtype=dtype, where=where)
  nvidia_eagle3.check_quant_config(path)
  V, Vd, D = cfg.target_vocab_size, cfg.draft_vocab_size, cfg.hidden_size
  ckpt = SafetensorsCheckpoint(path)
  found = _plan(ckpt, cfg)
  if "lm_head.weight" not in found:
    if target_lm_head is None:
      raise CheckpointError(f"{path} has no lm_head.weight; pass target_lm_head (the target's "
                            f"[{D}, {V}] output head) to use its rows for the draft vocabulary")
    if tuple(target_lm_head.shape) != (D, V):
      raise CheckpointError(f"target_lm_head has shape {list(target_lm_head.shape)}, expected "
                            f"[{D}, {V}] (hidden, target vocab; our [in, out] layout)")

  # The vocabulary map first: it is small, and a bad one should fail before reading weights.
  if "d2t" in found:
    d2t = _read(ckpt, found["d2t"])
  elif Vd == V:
    d2t = np.zeros((Vd,), np.int64)  # a full-vocabulary head needs no map (spec 2.1)
  else:
    raise DraftConfigError(f"{where}: draft_vocab_size {Vd} < vocab_size {V} but the checkpoint "
                           "has no d2t tensor: draft ids cannot be mapped to target ids")
  try:
    ids = check_d2t(d2t, V)
  except DraftConfigError as e:
    raise DraftConfigError(f"{path}: {e}") from None
  if "t2d" in found:
    t2d = _read(ckpt, found["t2d"])
    missing = np.nonzero(~t2d[ids])[0]
    if missing.size:
      i = int(missing[0])
      raise DraftConfigError(f"{path}: t2d is inconsistent with d2t: draft id {i} maps to target "
                             f"id {int(ids[i])} (i + d2t[i]) but t2d[{int(ids[i])}] is false")
    if int(t2d.sum()) != Vd:
      raise DraftConfigError(f"{path}: t2d marks {int(t2d.sum())} target ids, expected "
                             f"draft_vocab_size {Vd} (the ids d2t maps to)")

  dt = jnp.dtype(cfg.layer.dtype)
  arrays: dict[tuple[str, ...], Any] = {("d2t",): jnp.asarray(d2t.astype(np.int32))}
  for canonical, (dest, transform) in _hf_to_ours(cfg).items():
    if canonical not in found:  # lm_head only (the plan checked the others)
      continue
    raw_arr = _read(ckpt, found[canonical])
    arrays[dest] = jax.device_put(transform(raw_arr).astype(dt))
    del raw_arr
  if ("lm_head",) not in arrays:
    head = jnp.asarray(target_lm_head, dt)
    identity = Vd == V and not d2t.any()
    arrays[("lm_head",)] = head if identity else jnp.take(head, jnp.asarray(ids), axis=1)
  return _assemble(cfg, arrays)


# ----------------------------------------------------------------------------------------------
# EAGLE-3 layout: export
# ----------------------------------------------------------------------------------------------
def _write_safetensors(path: str, tensors: Mapping[str, np.ndarray]):
  """A single safetensors file (bf16 included, which safetensors.numpy cannot write)."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  arrays, offset = {}, 0
  for name in sorted(tensors):
    a = np.ascontiguousarray(tensors[name])
    if a.dtype not in _WRITE_CODES:
      raise TypeError(f"tensor {name}: cannot write dtype {a.dtype}")
    if a.dtype.byteorder == ">":
      a = a.astype(a.dtype.newbyteorder("<"))
    arrays[name] = a
    header[name] = {"dtype": _WRITE_CODES[a.dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # data section 8-byte aligned, as safetensors writes it
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for a in arrays.values():
      a.reshape(-1).view(np.uint8).tofile(f)


def _is_eagle3_export(path: str) -> bool:
  try:
    with open(os.path.join(path, HF_CONFIG)) as f:
      raw = json.load(f)
  except (OSError, ValueError):
    return False
  return (isinstance(raw, dict) and EAGLE3_ARCH in (raw.get("architectures") or [])
          and os.path.isfile(os.path.join(path, hf.SINGLE_FILE)))


def export_eagle3(draft: Eagle3Draft, out_dir: str, *, model_type: str = "llama",
                  overwrite: bool = False) -> str:
  """Writes the draft in the EAGLE-3 layout (config.json + model.safetensors).

  model_type: "llama" (EAGLE/SpecForge) or "llama4_text" (NVIDIA Maverick; the MLP width is
  then written as intermediate_size_mlp). d2t (int64) and t2d (bool) are written unless the
  draft has the full vocabulary with the identity map.
  """
  if model_type not in ("llama", "llama4_text"):
    raise ValueError(f"model_type must be 'llama' or 'llama4_text', got {model_type!r}")
  cfg, lc = draft.config, draft.config.layer
  D, H, K, Dh = cfg.hidden_size, lc.num_attention_heads, lc.num_key_value_heads, lc.head_dim
  V, Vd = cfg.target_vocab_size, cfg.draft_vocab_size
  flat = {k: np.asarray(v) for k, v in _flat_state(draft).items()}
  d2t = flat[("d2t",)].astype(np.int64)
  ids = check_d2t(d2t, V)
  inv = np.argsort(_rope_perm(Dh))  # hf[..., j] = ours[..., inv[j]]
  t = lambda x: np.ascontiguousarray(x.T)
  m = "midlayer."
  tensors = {
      "fc.weight": t(flat[("fc",)]),
      m + "hidden_norm.weight": flat[("hidden_norm", "weight")],
      m + "input_layernorm.weight": flat[("embed_norm", "weight")],
      m + "self_attn.q_proj.weight": t(flat[("layer", "attn", "q")][..., inv].reshape(2 * D, -1)),
      m + "self_attn.k_proj.weight": t(flat[("layer", "attn", "k")][..., inv].reshape(2 * D, -1)),
      m + "self_attn.v_proj.weight": t(flat[("layer", "attn", "v")].reshape(2 * D, -1)),
      m + "self_attn.o_proj.weight": t(flat[("layer", "attn", "o")].reshape(H * Dh, D)),
      m + "post_attention_layernorm.weight": flat[("layer", "post_attn_norm", "weight")],
      m + "mlp.gate_proj.weight": t(flat[("layer", "ffn", "gate")]),
      m + "mlp.up_proj.weight": t(flat[("layer", "ffn", "up")]),
      m + "mlp.down_proj.weight": t(flat[("layer", "ffn", "down")]),
      "norm.weight": flat[("final_norm", "weight")],
      "lm_head.weight": t(flat[("lm_head",)]),
  }
  if Vd < V or d2t.any():
    tensors["d2t"] = d2t
    tensors["t2d"] = _t2d_from(ids, V)
  rs = lc.rope_scaling
  config = {
      "architectures": [EAGLE3_ARCH], "model_type": model_type,
      "hidden_size": D, "num_attention_heads": H, "num_key_value_heads": K, "head_dim": Dh,
      "intermediate_size": lc.intermediate_size_mlp, "num_hidden_layers": 1,
      "hidden_act": "silu", "rms_norm_eps": lc.rms_norm_eps, "rope_theta": lc.rope_theta,
      "rope_scaling": None if rs is None else {
          "rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
          "high_freq_factor": rs.high_freq_factor,
          "original_max_position_embeddings": rs.original_max_position_embeddings},
      "max_position_embeddings": lc.max_position_embeddings, "vocab_size": V,
      "draft_vocab_size": Vd, "target_hidden_size": cfg.target_hidden_size,
      "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
      "norm_before_residual": cfg.norm_before_residual, "torch_dtype": lc.dtype,
      "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
                       "use_aux_hidden_state": True},
  }
  if model_type == "llama4_text":
    config["intermediate_size"] = lc.intermediate_size
    config["intermediate_size_mlp"] = lc.intermediate_size_mlp
  with store.AtomicDir(out_dir, overwrite, _is_eagle3_export, "an EAGLE-3 export") as tmp:
    _write_safetensors(os.path.join(tmp, hf.SINGLE_FILE), tensors)
    _write_json(os.path.join(tmp, HF_CONFIG), config)
  return os.path.abspath(out_dir)
