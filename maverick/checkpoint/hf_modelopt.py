"""Import of NVIDIA ModelOpt FP8 Hugging Face checkpoints (`quant_method: modelopt`, `quant_algo:
FP8`), e.g. nvidia/Llama-4-Maverick-17B-128E-Instruct-FP8, kept in FP8.

The layout, as ModelOpt's exporter writes it (modelopt/torch/export/unified_export_hf.py,
quant_utils.py) and TensorRT-LLM / vLLM / SGLang read it:
  * `hf_quant_config.json` {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
    "exclude_modules": [wildcards]}}, and/or config.json `quantization_config` with
    `quant_method: modelopt`, `quant_algo`, `ignore` (= exclude_modules) and `kv_cache_scheme`.
  * Every quantized linear: `weight` e4m3 in its HF layout, `weight_scale` = ONE f32 scalar per
    tensor (amax / 448) and `input_scale` = one f32 scalar: static activation quantization,
    x_q = e4m3(clip(x / input_scale)), y = (x_q @ w_q) * input_scale * weight_scale.
  * Routed experts stay fused as in the BF16 layout: `experts.gate_up_proj` e4m3 [E, D, 2F]
    ([gate | up] halves, concatenated) with `gate_up_proj_weight_scale` / `gate_up_proj_input_scale`
    (one scalar for all experts, gate and up share it), `experts.down_proj` [E, F, D] with
    `down_proj_weight_scale` / `down_proj_input_scale`.
  * `self_attn.k_proj.k_scale` / `v_proj.v_scale`: static KV-cache scales (amax / 448, clamped to
    >= 1 by the exporter). By default they become the per-layer scalars of the "fp8_static" KV
    cache (as TensorRT-LLM and vLLM run them: no per-token scale arrays); `kv_cache="fp8"` keeps
    the dynamic per-token-and-head scales instead, `kv_cache="bf16"` an unquantized cache in the
    model dtype (vLLM's `--kv-cache-dtype bfloat16`); both check the checkpoint's, then drop them.
  * Modules matching an `exclude_modules` wildcard (router, lm_head, vision tower, ...) stay BF16.
A per-tensor scale becomes our per-output-channel scale broadcast (exact). Everything is checked
from the headers before any data is read; each mismatch is one CheckpointError naming the tensor.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from maverick import config as config_lib
from maverick import model as model_lib
from maverick import weights
from maverick.quant import config as quant_config
from maverick.quant import ops as quant_ops
from maverick.checkpoint import hf, hf_fp8
from maverick.checkpoint.hf import CheckpointError

QUANT_CONFIG_FILE = "hf_quant_config.json"
# The ModelOpt algorithms other loaders read; only FP8 (per-tensor) is imported here.
_OTHER_ALGOS = ("FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "NVFP4_AWQ", "W4A8_AWQ",
                "W4A16_AWQ", "INT4_AWQ", "INT8_SQ", "MXFP8", "W4A8_NVFP4_FP8")


@dataclasses.dataclass(frozen=True)
class ModelOptConfig:
  quant_algo: str
  kv_cache_quant_algo: str | None
  exclude_modules: tuple[str, ...]
  source: str  # the file it was read from (for error messages)


def _read_json(path: str) -> dict:
  try:
    with open(path) as f:
      d = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(d, dict):
    raise CheckpointError(f"{path}: expected a JSON object")
  return d


def _normalize(q: dict, where: str) -> ModelOptConfig | None:
  """Both spellings: the legacy nested {"quantization": {...exclude_modules}} and the flat
  compressed-tensors-like one ({"quant_algo", "ignore", "kv_cache_scheme"})."""
  if "quantization" in q:
    q = q["quantization"]
    if not isinstance(q, dict):
      raise CheckpointError(f"{where}: 'quantization' must be an object, got {q!r}")
    excl = q.get("exclude_modules")
  else:
    excl = q.get("exclude_modules", q.get("ignore"))
  algo = q.get("quant_algo")
  if algo is None:  # e.g. NVIDIA's BF16 EAGLE-3 head ships quant_algo null: not quantized
    return None
  kv = q.get("kv_cache_quant_algo")
  if kv is None and "kv_cache_scheme" in q:
    kv = q["kv_cache_scheme"]
    if isinstance(kv, dict):  # {"num_bits": 8, "type": "float", "dynamic": false} = FP8
      kv = "FP8" if (kv.get("num_bits"), kv.get("type")) == (8, "float") else json.dumps(kv)
  excl = [] if excl is None else excl
  if not (isinstance(excl, list) and all(isinstance(e, str) for e in excl)):
    raise CheckpointError(f"{where}: exclude_modules must be a list of wildcard strings, got "
                          f"{excl!r}")
  return ModelOptConfig(str(algo).upper(), None if kv is None else str(kv).upper(), tuple(excl),
                        where)


def detect(hf_dir: str) -> ModelOptConfig | None:
  """The ModelOpt quantization of `hf_dir`, or None when it is not a ModelOpt checkpoint.
  hf_quant_config.json is authoritative (as in vLLM); config.json's quantization_config, when it
  is ModelOpt's too, must agree with it on the algorithm."""
  found = []
  path = os.path.join(hf_dir, QUANT_CONFIG_FILE)
  if os.path.isfile(path):
    found.append(_normalize(_read_json(path), path))
  qc = hf_fp8.quantization_config(hf_dir)
  if qc is not None and str(qc.get("quant_method", "")).lower() == "modelopt":
    found.append(_normalize(qc, os.path.join(hf_dir, "config.json") + " quantization_config"))
  found = [f for f in found if f is not None]
  if len(found) == 2 and (found[0].quant_algo, found[0].kv_cache_quant_algo) != (
      found[1].quant_algo, found[1].kv_cache_quant_algo):
    a, b = found
    raise CheckpointError(f"{a.source} (quant_algo {a.quant_algo}, kv {a.kv_cache_quant_algo}) "
                          f"and {b.source} (quant_algo {b.quant_algo}, kv "
                          f"{b.kv_cache_quant_algo}) disagree; fix one of them")
  return found[0] if found else None


def check_unconfigured(ckpt: hf.SafetensorsCheckpoint, hf_dir: str) -> None:
  """For a directory `detect` found no ModelOpt config in: its per-tensor scalar weight_scale,
  input_scale or k/v_scale tensors are ModelOpt's layout, which the compressed-tensors reader would
  refuse with a scale-shape error; name the missing hf_quant_config.json instead. A directory with
  any other quantization_config is left to that format's reader."""
  if hf_fp8.quantization_config(hf_dir) is not None:
    return
  marks = sorted(n for n, i in ckpt.tensors.items()
                 if n.endswith(("input_scale", "k_proj.k_scale", "v_proj.v_scale"))
                 or (n.endswith("weight_scale") and i.shape in ((), (1,))))
  if not marks:
    return
  kv = '"FP8"' if any(n.endswith(("k_scale", "v_scale")) for n in marks) else "null"
  more = f" and {len(marks) - 1} more" if len(marks) > 1 else ""
  raise CheckpointError(
      f"{hf_dir} holds ModelOpt FP8 per-tensor scales ({marks[0]}{more}) but no "
      f"{QUANT_CONFIG_FILE} and no ModelOpt quantization_config in config.json; "
      f"restore the checkpoint's {QUANT_CONFIG_FILE}: {{\"quantization\": {{\"quant_algo\": "
      f"\"FP8\", \"kv_cache_quant_algo\": {kv}, \"exclude_modules\": [the modules stored in "
      "BF16, e.g. \"lm_head\", \"*router*\"]}}")


def _check_algos(mo: ModelOptConfig) -> None:
  if mo.quant_algo != "FP8":
    known = " (a ModelOpt format maverick does not import)" if mo.quant_algo in _OTHER_ALGOS else ""
    raise CheckpointError(f"{mo.source}: quant_algo {mo.quant_algo!r}{known} is not supported; "
                          "the ModelOpt import reads quant_algo 'FP8' (per-tensor FP8 weights "
                          "and static activation scales)")
  if mo.kv_cache_quant_algo not in (None, "FP8"):
    raise CheckpointError(f"{mo.source}: kv_cache_quant_algo {mo.kv_cache_quant_algo!r} is not "
                          "supported; use 'FP8' or none")


# ----------------------------------------------------------------------------------------------
# Planning
# ----------------------------------------------------------------------------------------------
def _module(name: str) -> str:
  """The module a stored tensor belongs to (what exclude_modules patterns name)."""
  if name.endswith((".weight", "experts.gate_up_proj", "experts.down_proj")):
    return name.rsplit(".", 1)[0]
  return name


def _excluded_by(mo: ModelOptConfig, stored: str) -> str | None:
  """The first exclude_modules wildcard matching the tensor's module, with or without the
  multimodal `language_model.` prefix (as SGLang matches); `*` crosses dots (fnmatch, as vLLM)."""
  mods = {_module(stored), _module(stored.removeprefix(hf._PREFIX))}
  for pattern in mo.exclude_modules:
    if any(fnmatch.fnmatchcase(m, pattern) for m in mods):
      return pattern
  return None


def _scale_names(canonical: str) -> tuple[str, str]:
  """(weight scale, input scale) tensor names of an FP8 weight."""
  if canonical.endswith(".weight"):
    base = canonical[:-len("weight")]
    return base + "weight_scale", base + "input_scale"
  return canonical + "_weight_scale", canonical + "_input_scale"


def _check_scalar(st: hf_fp8._Stored, name: str, what: str) -> str:
  info, stored = st.info(name), st.names[name]
  if info.shape not in ((), (1,)):
    hint = ("; per-channel weight scales are quant_algo FP8_PER_CHANNEL_PER_TOKEN, which is not "
            "supported") if what == "weight_scale" else ""
    raise CheckpointError(
        f"scale tensor {stored} has shape {list(info.shape)}; ModelOpt FP8 (quant_algo FP8) "
        f"stores {what} as one per-tensor scalar (shape [] or [1]){hint}")
  if info.dtype not in hf_fp8._SCALE_DTYPES:
    raise CheckpointError(f"scale tensor {stored} has dtype {info.dtype}; expected one of "
                          f"{list(hf_fp8._SCALE_DTYPES)}")
  return st.use(name)


def _positive(name: str, x: np.ndarray) -> np.float32:
  v = np.float32(np.asarray(x, np.float32).reshape(()))
  if not np.isfinite(v) or v <= 0:
    raise CheckpointError(f"scale tensor {name} is {v}; a per-tensor scale must be finite and "
                          "> 0 (the checkpoint is corrupt)")
  return v


def plan(ckpt: hf.SafetensorsCheckpoint, cfg: config_lib.Config, mo: ModelOptConfig, *,
         activations: str | None = None, kv_cache: str | None = None
         ) -> tuple[config_lib.Config, list[hf_fp8.Item]]:
  """Validates a ModelOpt FP8 checkpoint from its headers; returns (config with the derived
  `quant`, read plan). activations: "static_per_tensor" (default: the checkpoint's calibrated
  input scales, as TensorRT-LLM / vLLM run it), or "dynamic_per_token" / "none" (input scales
  are validated, then dropped). kv_cache: "fp8_static" (default when the checkpoint sets
  kv_cache_quant_algo FP8: its k_scale / v_scale per layer), "fp8" (per-token scales computed
  at run time) or "bf16" (unquantized, in the model dtype); with the last two the checkpoint's
  k/v scales are validated, then dropped."""
  _check_algos(mo)
  activations = activations or "static_per_tensor"
  if activations not in quant_config.ACTIVATION_MODES:
    raise CheckpointError(
        f"activations {activations!r}: use one of {quant_config.ACTIVATION_MODES}")
  kv_cache = _kv_cache_mode(mo, kv_cache)
  static = activations == "static_per_tensor"
  dtype = jnp.dtype(cfg.dtype)
  st = hf_fp8._Stored(ckpt)
  names = hf_fp8._quant_names(cfg)
  every = cfg.replace(quant=quant_config.QuantConfig(skip=()))
  abstract = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.split(
      model_lib.abstract_model(every))[1])}
  in_axes = weights.fp8_declarations(every)
  items: list[hf_fp8.Item] = []
  fp8_paths: set = set()
  missing = []
  for canonical, src in hf.weight_map(cfg).items():
    if not st.has(canonical):
      missing.append(canonical)
      continue
    paths = [t.path for t in src.targets]
    stored, info = st.names[canonical], st.info(canonical)
    if info.shape != src.shape:
      raise CheckpointError(f"tensor {stored} has shape {list(info.shape)}, expected "
                            f"{list(src.shape)} from config.json")
    w_scale, i_scale = _scale_names(canonical)
    pattern = _excluded_by(mo, stored)
    layer_linear = canonical.startswith("model.layers.") and all(p in names for p in paths)
    if info.dtype == hf_fp8.FP8_CODE:
      if pattern is not None:
        raise CheckpointError(f"tensor {stored} is FP8 ({info.dtype}) but exclude_modules "
                              f"pattern {pattern!r} in {mo.source} keeps module "
                              f"{_module(stored)} in BF16; the checkpoint and its quant config "
                              "disagree")
      if not layer_linear:
        raise CheckpointError(f"tensor {stored} is FP8 but maverick imports only the decoder "
                              "layers' linear projections in FP8 from a ModelOpt checkpoint "
                              "(embedding, lm_head and norms stay BF16)")
      prefix = hf._PREFIX if stored.startswith(hf._PREFIX) else ""
      for n, what in ((w_scale, "weight_scale"), (i_scale, "input_scale")):
        if not st.has(n):
          raise CheckpointError(f"tensor {stored} is FP8 but its per-tensor {what} {prefix}{n} "
                                "is missing; every ModelOpt FP8 linear needs weight_scale and "
                                "input_scale")
      ws, ins = _check_scalar(st, w_scale, "weight_scale"), _check_scalar(st, i_scale,
                                                                            "input_scale")
      fp8_paths.update(paths)
      items.append(hf_fp8.Item(paths[0], (st.use(canonical), ws, ins),
                               _fp8_build(stored, ws, ins, src, abstract, in_axes, static)))
      continue
    if info.dtype not in hf._FLOAT_DTYPES:
      raise CheckpointError(f"tensor {stored} has dtype {info.dtype}; expected one of "
                            f"{sorted(hf._FLOAT_DTYPES)} or {hf_fp8.FP8_CODE}")
    for n in (w_scale, i_scale):
      if st.has(n):
        raise CheckpointError(f"scale tensor {st.names[n]} belongs to {stored}, which is "
                              f"{info.dtype}, not FP8; the checkpoint is inconsistent")
    if layer_linear and pattern is None:
      raise CheckpointError(f"tensor {stored} is {info.dtype}, but no exclude_modules pattern in "
                            f"{mo.source} matches module {_module(stored)}, so ModelOpt would "
                            "have stored it in FP8 with weight_scale and input_scale; add the "
                            "module to exclude_modules if it really is unquantized")
    items.append(hf_fp8.Item(paths[0], (st.use(canonical),),
                             hf_fp8._bf16_build(stored, src, dtype)))

  if missing:
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    raise CheckpointError(f"missing tensor(s) {sorted(missing)[:5]}{more} in {ckpt.directory}: "
                          "the checkpoint does not match its config.json")
  items.extend(_kv_scale_items(st, cfg, mo, static=kv_cache == "fp8_static"))
  extra = sorted(st.names[c] for c in set(st.names) - st.used)
  if extra:
    orphan = [n for n in extra if n.endswith(("weight_scale", "input_scale"))]
    if orphan:
      raise CheckpointError(f"scale tensor(s) {orphan[:5]} have no matching FP8 weight in "
                            f"{ckpt.directory}")
    raise CheckpointError(f"unexpected tensor(s) {extra[:5]} in {ckpt.directory}: the checkpoint "
                          "does not match its config.json")
  quant = None
  if fp8_paths:
    quant = quant_config.QuantConfig(
        weights="fp8", activations=activations,
        kv_cache=kv_cache,
        skip=hf_fp8._skip_list(names, fp8_paths))
    declared = {p for p, n in names.items() if quant.quantizes(n)}
    assert declared == fp8_paths, (sorted(declared ^ fp8_paths)[:5], quant.skip)
  items.sort(key=lambda it: (hf_fp8._part(it.part_path), ckpt.tensors[it.reads[0]].file,
                             it.reads[0]))
  return cfg.replace(quant=quant), items


def _kv_cache_mode(mo: ModelOptConfig, kv_cache: str | None) -> str | None:
  """The KV-cache format to run: the checkpoint's static scales by default, or the choice."""
  if kv_cache is None:
    return "fp8_static" if mo.kv_cache_quant_algo == "FP8" else None
  if kv_cache not in quant_config.KV_CHOICES:
    raise CheckpointError(f"kv_cache {kv_cache!r}: use one of {quant_config.KV_CHOICES}")
  if kv_cache == quant_config.UNQUANTIZED_KV:  # the k/v scales are checked, then dropped
    return None
  if kv_cache == "fp8_static" and mo.kv_cache_quant_algo != "FP8":
    raise CheckpointError(f"kv_cache 'fp8_static' needs the checkpoint's k_scale / v_scale, but "
                          f"{mo.source} sets no kv_cache_quant_algo FP8; use kv_cache 'fp8' "
                          "(per-token scales at run time)")
  return kv_cache


def _kv_scale_items(st: hf_fp8._Stored, cfg, mo: ModelOptConfig, *, static: bool
                    ) -> list[hf_fp8.Item]:
  """k_scale / v_scale: checked (scalar, finite, > 0); with `static` each layer's pair becomes its
  attention's k_cache_scale / v_cache_scale (every layer needs both), else they are dropped."""
  items = []
  for i in range(cfg.num_hidden_layers):
    reads, targets = [], []
    for proj, kind, param in (("k_proj", "k_scale", model_lib.KV_CACHE_SCALES[0]),
                              ("v_proj", "v_scale", model_lib.KV_CACHE_SCALES[1])):
      name = f"model.layers.{i}.self_attn.{proj}.{kind}"
      if not st.has(name):
        if static:
          raise CheckpointError(
              f"the static FP8 KV cache needs {name} (kv_cache_quant_algo FP8 in {mo.source}), "
              "which is missing; pass kv_cache='fp8' (--kv_cache=fp8) for per-token scales")
        continue
      if mo.kv_cache_quant_algo != "FP8":
        raise CheckpointError(f"tensor {st.names[name]} is a KV-cache scale but {mo.source} "
                              "sets no kv_cache_quant_algo FP8")
      reads.append(_check_scalar(st, name, kind))
      targets.append(("layers", i, "attn", param))

    def build(raw, reads=tuple(reads), targets=tuple(targets)):
      values = {t: np.asarray(_positive(n, raw[n]), np.float32) for n, t in zip(reads, targets)}
      return values if static else {}
    if reads:
      items.append(hf_fp8.Item(("layers", i, "attn", "k"), tuple(reads), build))
  return items


def _fp8_build(stored, ws, ins, src: hf.Source, abstract, in_axes, static: bool):
  """HF layout e4m3 -> our K-major layout (as hf_fp8: for [out, in] linears the target transpose
  and to_kmajor cancel; fused experts [E, in, out] really transpose); the scalar weight scale is
  broadcast over the output channels (exact), the input scale kept as a scalar param."""
  def build(raw):
    q = hf_fp8._checked_fp8(stored, raw[stored])
    s = _positive(ws, raw[ws])  # 0 would silently zero the whole layer
    si = _positive(ins, raw[ins])
    out = {}
    for t in src.targets:
      out[t.path] = np.ascontiguousarray(quant_ops.to_kmajor(t.transform(q), in_axes[t.path]))
      sp = weights.scale_path(t.path)
      out[sp] = np.full(abstract[sp].shape, s, np.float32)
      if static:
        out[t.path[:-1] + (f"{t.path[-1]}_input_scale",)] = np.asarray(si, np.float32)
    return out
  return build
