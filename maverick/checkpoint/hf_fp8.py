"""Import of FP8 Hugging Face Llama 4 checkpoints, kept in FP8.

Two layouts (llama4_spec.md §9):
  * compressed-tensors (the official `Llama-4-Maverick-17B-128E-Instruct-FP8`): routed experts
    unfused, one per expert, `experts.{e}.{gate,up,down}_proj.weight` e4m3 [out, in] with
    `.weight_scale` [out, 1]; any other linear may carry `weight_scale` [out, 1] too.
  * fbgemm_fp8: experts fused as in the BF16 layout, `experts.gate_up_proj` e4m3 [E, D, 2F] with
    `gate_up_proj_scale` [E, 1, 2F] and `experts.down_proj` [E, F, D] with `down_proj_scale`
    [E, D, 1]; linears `weight` + `weight_scale` [out, 1].
A tensor is FP8 exactly when its scale tensor exists (the checkpoint decides per tensor: which modules
the official checkpoint quantizes is not documented); everything else is read as BF16. From that the
importer derives the model's `QuantConfig` (`skip` lists what stayed BF16) and the activation mode
from `quantization_config` in config.json. Every name, shape and dtype is checked from the headers
before any data is read; NaN/inf in a weight or scale is an error naming the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterator

import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from maverick import config as config_lib
from maverick import model as model_lib
from maverick import weights
from maverick.quant import config as quant_config
from maverick.quant import ops as quant_ops
from maverick.checkpoint import hf, parts
from maverick.checkpoint.hf import CheckpointError, Path

FP8_CODE = "F8_E4M3"
_SCALE_DTYPES = ("F32", "BF16", "F16")


def is_fp8(ckpt: hf.SafetensorsCheckpoint) -> bool:
  """Whether any tensor is FP8 or is an FP8 scale."""
  return any(i.dtype.startswith("F8") or n.endswith(("weight_scale", "_proj_scale"))
             for n, i in ckpt.tensors.items())


@dataclasses.dataclass(frozen=True)
class Item:
  """Model parameters built from a group of stored tensors (read together)."""
  part_path: Path  # a parameter path of the group (decides its checkpoint part)
  reads: tuple[str, ...]
  build: Callable[[dict[str, np.ndarray]], dict[Path, np.ndarray]]


# ----------------------------------------------------------------------------------------------
# quantization_config
# ----------------------------------------------------------------------------------------------
def quantization_config(hf_dir: str) -> dict | None:
  path = os.path.join(hf_dir, "config.json")
  with open(path) as f:
    raw = json.load(f)
  q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
  if q is not None and not isinstance(q, dict):
    raise CheckpointError(f"{path}: quantization_config must be an object, got {q!r}")
  return q


def activation_settings(qcfg: dict | None, where: str) -> tuple[str, float | None]:
  """(activations mode, activation_scale_ub) from a HF quantization_config; errors name what is
  unsupported. Without a quantization_config, activations are quantized per token (as both
  supported layouts do)."""
  if qcfg is None:
    return "dynamic_per_token", None
  method = qcfg.get("quant_method")
  if method == "fbgemm_fp8":
    ub = qcfg.get("activation_scale_ub")
    return "dynamic_per_token", None if ub is None else float(ub)
  if method != "compressed-tensors":
    raise CheckpointError(f"{where}: quantization_config.quant_method {method!r} is not supported; "
                          "FP8 import reads 'compressed-tensors' and 'fbgemm_fp8'")
  groups = qcfg.get("config_groups") or {}
  if not isinstance(groups, dict) or not groups:
    raise CheckpointError(f"{where}: compressed-tensors quantization_config has no config_groups")
  modes = set()
  for gname, g in groups.items():
    w = (g or {}).get("weights") or {}
    if (w.get("num_bits"), w.get("type"), w.get("strategy")) != (8, "float", "channel"):
      raise CheckpointError(
          f"{where}: config_groups.{gname}.weights is {w.get('num_bits')}-bit {w.get('type')} "
          f"with strategy {w.get('strategy')!r}; only 8-bit float per-channel weights (FP8 "
          "e4m3, strategy 'channel') are supported")
    a = (g or {}).get("input_activations")
    if a is None:
      modes.add("none")
    elif (a.get("num_bits"), a.get("type"), a.get("strategy"), a.get("dynamic")) == (
        8, "float", "token", True):
      modes.add("dynamic_per_token")
    else:
      raise CheckpointError(
          f"{where}: config_groups.{gname}.input_activations {a}: only dynamic per-token 8-bit "
          "float activations (strategy 'token', dynamic true) or none are supported")
  if len(modes) > 1:
    raise CheckpointError(f"{where}: config groups disagree on activation quantization {modes}")
  return modes.pop(), None


# ----------------------------------------------------------------------------------------------
# Planning
# ----------------------------------------------------------------------------------------------
def _scale_name(name: str) -> str:
  return name[:-len("weight")] + "weight_scale" if name.endswith(".weight") else name + "_scale"


def _quant_names(cfg: config_lib.Config) -> dict[Path, str]:
  """Our parameter path -> quant name, for every weight the model can store in FP8."""
  every = cfg.replace(quant=quant_config.QuantConfig(skip=()))
  _, abstract = nnx.split(model_lib.abstract_model(every))
  return {p: v.get_metadata()["quant_name"] for p, v in nnx.to_flat_state(abstract)
          if "quant_name" in v.get_metadata()}


def _skip_list(names: dict[Path, str], fp8_paths: set[Path]) -> tuple[str, ...]:
  """The shortest skip list in kind terms ('attn', 'router', ...) that leaves exactly
  `fp8_paths` in FP8; a kind only partly FP8 lists its BF16 weights by name."""
  kind = lambda n: n.split(".")[2] if n.startswith("layers.") else n
  by_kind: dict[str, list[tuple[str, bool]]] = {}
  for p, n in names.items():
    by_kind.setdefault(kind(n), []).append((n, p in fp8_paths))
  skip = []
  for k in sorted(by_kind):
    entries = by_kind[k]
    if not any(is_fp8 for _, is_fp8 in entries):
      skip.append(k)
    else:
      skip.extend(sorted(n for n, is_fp8 in entries if not is_fp8))
  return tuple(skip)


class _Stored:
  """Stored tensors by canonical name (without `language_model.`), with use tracking."""

  def __init__(self, ckpt: hf.SafetensorsCheckpoint):
    self.ckpt = ckpt
    self.names: dict[str, str] = {}
    for stored in ckpt.tensors:
      canonical = stored.removeprefix(hf._PREFIX)
      if canonical.startswith(hf._IGNORED_PREFIXES):
        continue
      if canonical in self.names:
        raise CheckpointError(f"tensor {canonical} appears twice ({self.names[canonical]}, "
                              f"{stored})")
      self.names[canonical] = stored
    self.used: set[str] = set()

  def has(self, canonical: str) -> bool:
    return canonical in self.names

  def info(self, canonical: str) -> hf.TensorInfo:
    return self.ckpt.tensors[self.names[canonical]]

  def use(self, canonical: str) -> str:
    self.used.add(canonical)
    return self.names[canonical]


def _check_weight(st: _Stored, name: str, shape, fp8: bool):
  info = st.info(name)
  stored = st.names[name]
  if info.shape != tuple(shape):
    raise CheckpointError(f"tensor {stored} has shape {list(info.shape)}, expected {list(shape)} "
                          "from config.json")
  if fp8 and info.dtype != FP8_CODE:
    raise CheckpointError(f"tensor {stored} has a scale ({_scale_name(stored)}) but dtype "
                          f"{info.dtype}; an FP8 weight must be {FP8_CODE} (e4m3)")
  if not fp8 and info.dtype.startswith("F8"):
    raise CheckpointError(f"tensor {stored} is FP8 ({info.dtype}) but its scale "
                          f"{_scale_name(stored)} is missing; every FP8 weight needs its "
                          "per-output-channel scale tensor")
  if not fp8 and info.dtype not in hf._FLOAT_DTYPES:
    raise CheckpointError(f"tensor {stored} has dtype {info.dtype}; expected one of "
                          f"{sorted(hf._FLOAT_DTYPES)} or {FP8_CODE} with a scale")


def _check_scale(st: _Stored, name: str, shape, weight: str):
  info = st.info(name)
  stored = st.names[name]
  if info.shape != tuple(shape):
    raise CheckpointError(f"scale tensor {stored} has shape {list(info.shape)}, expected "
                          f"{list(shape)} (one scale per output channel of {weight})")
  if info.dtype not in _SCALE_DTYPES:
    raise CheckpointError(f"scale tensor {stored} has dtype {info.dtype}; expected one of "
                          f"{list(_SCALE_DTYPES)}")


def _checked_fp8(name: str, q: np.ndarray) -> np.ndarray:
  try:
    quant_ops.check_finite(name, q)
  except quant_ops.QuantError as e:
    raise CheckpointError(str(e)) from None
  return q


def _checked_scale(name: str, s: np.ndarray) -> np.ndarray:
  s = s.astype(np.float32)
  if not np.isfinite(s).all() or (s < 0).any():
    bad = int(np.count_nonzero(~np.isfinite(s) | (s < 0)))
    raise CheckpointError(f"scale tensor {name} has {bad} NaN/inf/negative value(s); the "
                          "checkpoint is corrupt")
  return s


def _checked_float(name: str, x: np.ndarray) -> np.ndarray:
  if not np.isfinite(x.astype(np.float32)).all():
    raise CheckpointError(f"tensor {name} holds NaN/inf values; the checkpoint is corrupt")
  return x


def plan(ckpt: hf.SafetensorsCheckpoint, cfg: config_lib.Config, hf_dir: str
         ) -> tuple[config_lib.Config, list[Item]]:
  """Validates an FP8 checkpoint from its headers; returns (config with the derived `quant`,
  read plan). Raises CheckpointError naming the tensor for anything inconsistent."""
  where = os.path.join(hf_dir, "config.json")
  activations, ub = activation_settings(quantization_config(hf_dir), where)
  dtype = jnp.dtype(cfg.dtype)
  st = _Stored(ckpt)
  names = _quant_names(cfg)
  every_fp8 = cfg.replace(quant=quant_config.QuantConfig(skip=()))
  abstract_every = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.split(
      model_lib.abstract_model(every_fp8))[1])}
  in_axes = weights.fp8_declarations(every_fp8)
  F, E = cfg.intermediate_size, cfg.num_local_experts
  items: list[Item] = []
  fp8_paths: set[Path] = set()
  missing = []

  def scale_shape(path):
    return abstract_every[path[:-1] + (f"{path[-1]}_scale",)].shape

  for canonical, src in hf.weight_map(cfg).items():
    paths = [t.path for t in src.targets]
    if not st.has(canonical) and st.has(_first_expert(canonical)):  # compressed-tensors experts
      items.extend(_per_expert_items(st, canonical, src, cfg, dtype, fp8_paths, scale_shape))
      continue
    if not st.has(canonical):
      missing.append(canonical)
      continue
    scale = _scale_name(canonical)
    fp8 = st.has(scale)
    _check_weight(st, canonical, src.shape, fp8)
    stored = st.use(canonical)
    if not fp8:
      items.append(Item(paths[0], (stored,), _bf16_build(stored, src, dtype)))
      continue
    bad = [p for p in paths if p not in names]
    if bad:
      raise CheckpointError(f"tensor {stored} has a scale {_scale_name(stored)}, but maverick "
                            f"keeps {'.'.join(map(str, bad[0]))} unquantized (only linear "
                            "weights and the embedding can be FP8)")
    if canonical.endswith("experts.gate_up_proj"):
      sshape, cut = (E, 1, 2 * F), lambda s, i: s[:, 0, i * F:(i + 1) * F]
    elif canonical.endswith("experts.down_proj"):
      sshape, cut = (E, cfg.hidden_size, 1), lambda s, i: s[:, :, 0]
    else:
      sshape, cut = (src.shape[0], 1), None
    _check_scale(st, scale, sshape, stored)
    stored_scale = st.use(scale)
    fp8_paths.update(paths)
    items.append(Item(paths[0], (stored, stored_scale),
                      _fp8_build(stored, stored_scale, src, cut, scale_shape, in_axes)))

  if missing:
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    raise CheckpointError(f"missing tensor(s) {sorted(missing)[:5]}{more} in {ckpt.directory}: "
                          "the checkpoint does not match its config.json")
  extra = sorted(st.names[c] for c in set(st.names) - st.used)
  if extra:
    orphan = [n for n in extra if n.endswith(("weight_scale", "_proj_scale"))]
    if orphan:
      raise CheckpointError(f"scale tensor(s) {orphan[:5]} have no matching FP8 weight in "
                            f"{ckpt.directory}")
    statics = [n for n in extra if n.endswith("input_scale")]
    if statics:
      raise CheckpointError(f"{statics[:3]}: static activation scales are not supported; FP8 "
                            "import expects dynamic per-token activations (no input_scale)")
    raise CheckpointError(f"unexpected tensor(s) {extra[:5]} in {ckpt.directory}: the checkpoint "
                          "does not match its config.json")
  quant = None
  if fp8_paths:
    quant = quant_config.QuantConfig(weights="fp8", activations=activations,
                                     skip=_skip_list(names, fp8_paths), activation_scale_ub=ub)
  new_cfg = cfg.replace(quant=quant)
  if quant is not None:
    declared = {p for p, n in names.items() if quant.quantizes(n)}
    assert declared == fp8_paths, (sorted(declared ^ fp8_paths)[:5], quant.skip)
  items.sort(key=lambda it: (_part(it.part_path), ckpt.tensors[it.reads[0]].file, it.reads[0]))
  return new_cfg, items


def _first_expert(fused: str) -> str:
  """`…experts.gate_up_proj` -> `…experts.0.gate_proj.weight` (down: `…experts.0.down_proj.weight`);
  any other name is returned unchanged."""
  if fused.endswith("experts.gate_up_proj"):
    return fused[:-len("gate_up_proj")] + "0.gate_proj.weight"
  if fused.endswith("experts.down_proj"):
    return fused[:-len("down_proj")] + "0.down_proj.weight"
  return fused


def _part(path: Path) -> str:
  return parts.part_of(path)


def _bf16_build(stored, src: hf.Source, dtype):
  def build(raw):
    x = _checked_float(stored, raw[stored])
    return {t.path: t.transform(x).astype(dtype) for t in src.targets}
  return build


def _fp8_build(stored, stored_scale, src: hf.Source, cut, scale_shape, in_axes):
  """Our FP8 weights are K-major (maverick.quant.to_kmajor). HF linears are [out, in] already: the
  target transform (to our declared [in, out]) and to_kmajor cancel, at the cost of one extra host
  copy; fused fbgemm experts are (E, in, out) and really are transposed."""
  def build(raw):
    q = _checked_fp8(stored, raw[stored])
    s = _checked_scale(stored_scale, raw[stored_scale])
    out = {}
    for i, t in enumerate(src.targets):
      out[t.path] = np.ascontiguousarray(quant_ops.to_kmajor(t.transform(q), in_axes[t.path]))
      sp = t.path[:-1] + (f"{t.path[-1]}_scale",)
      out[sp] = (s if cut is None else cut(s, i)).reshape(scale_shape(t.path)).astype(np.float32)
    return out
  return build


def _per_expert_items(st: _Stored, canonical: str, src: hf.Source, cfg, dtype, fp8_paths,
                      scale_shape) -> list[Item]:
  """compressed-tensors experts: E tensors `experts.{e}.{proj}_proj.weight` [out, in] per target,
  stacked into our [E, in, out] layout (BF16) or, as they are, into K-major [E, out, in] (FP8);
  scales [out, 1] into [E, out]."""
  D, F, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts
  base = canonical[:-len("gate_up_proj")] if canonical.endswith("gate_up_proj") else \
      canonical[:-len("down_proj")]
  projs = ("gate", "up") if canonical.endswith("gate_up_proj") else ("down",)
  items = []
  for proj, target in zip(projs, src.targets):
    shape = (D, F) if proj == "down" else (F, D)
    names = [f"{base}{e}.{proj}_proj.weight" for e in range(E)]
    absent = [n for n in names if not st.has(n)]
    if absent:
      raise CheckpointError(f"missing tensor(s) {absent[:5]}: per-expert checkpoints need all "
                            f"{E} experts of {base[:-1]}")
    fp8 = [st.has(_scale_name(n)) for n in names]
    for n, f in zip(names, fp8):
      _check_weight(st, n, shape, f)
    if any(fp8) and not all(fp8):
      bf16 = [n for n, f in zip(names, fp8) if not f]
      raise CheckpointError(f"experts of {base[:-1]} mix FP8 and BF16 {proj}_proj weights "
                            f"({bf16[:3]} have no weight_scale); they must all be FP8 or all BF16")
    for n in names:
      if fp8[0]:
        _check_scale(st, _scale_name(n), (shape[0], 1), st.names[n])
    reads = tuple(st.use(n) for n in names)
    scales = tuple(st.use(_scale_name(n)) for n in names) if fp8[0] else ()
    if fp8[0]:
      fp8_paths.add(target.path)
    items.append(Item(target.path, reads + scales,
                      _stack_build(target.path, reads, scales, dtype, scale_shape)))
  return items


def _stack_build(path, reads, scales, dtype, scale_shape):
  def build(raw):
    if not scales:
      w = np.stack([_checked_float(n, raw[n]).T for n in reads])
      return {path: w.astype(dtype)}
    q = np.stack([_checked_fp8(n, raw[n]) for n in reads])
    s = np.stack([_checked_scale(n, raw[n])[:, 0] for n in scales])
    return {path: np.ascontiguousarray(q),
            path[:-1] + (f"{path[-1]}_scale",): s.reshape(scale_shape(path))}
  return build


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------
def iter_params(ckpt: hf.SafetensorsCheckpoint, items: list[Item], *, progress: bool = False
                ) -> Iterator[tuple[Path, np.ndarray]]:
  """(path, host array) of each parameter; one group's stored tensors and outputs in memory at a
  time (the stored ones are freed before the outputs are handed out)."""
  for item in tqdm(items, desc="importing fp8", unit="group", disable=not progress):
    raw = {n: ckpt.read(n) for n in item.reads}
    built = item.build(raw)
    del raw
    while built:
      path = next(iter(built))
      yield path, built.pop(path)


def iter_parts(ckpt, items, *, progress: bool = False, place=lambda x: x):
  """(part, {key in part: place(array)}), a part at a time (the items are sorted by part)."""
  current, flat = None, {}
  for path, x in iter_params(ckpt, items, progress=progress):
    part = parts.part_of(path)
    if part != current and flat:
      yield current, flat
      flat = {}
    current = part
    flat[parts.part_key(path)] = place(x)
    del x
  if flat:
    yield current, flat
