"""Our checkpoint format, HF conversion into it, and restore with target shardings.

Layout of a converted checkpoint directory:
  maverick.json      {"format": ..., "config": {...}, "parts": [...]}
  params/<part>/     one orbax checkpoint per part: "embed", "layer_000", ..., "head"
  tokenizer files    copied from the source when present

One orbax checkpoint per layer lets conversion stream (one layer plus the tensor being read in
memory, so an 800 GB checkpoint converts on a normal host) and restore place each part straight into its target sharding. Everything is
written to `<out>.tmp-<pid>` and renamed at the end: a failed run leaves no output directory.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import shutil
import sys
from typing import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from tqdm import tqdm

from maverick import config as config_lib
from maverick import model as model_lib
from maverick import sharding as sharding_lib
from maverick import weights
from maverick.quant import config as quant_config
from maverick.vision import model as vision_lib
from maverick.checkpoint import hf, hf_fp8, hf_modelopt, hf_vision
from maverick.checkpoint.parts import full_path, part_key, part_of
from maverick.checkpoint.hf import CheckpointError

FORMAT = "maverick-orbax/2"
# Version 1 stored FP8 weights in the declared (input, output) layout; version 2 stores them K-major.
# BF16 checkpoints are the same in both.
FORMAT_V1 = "maverick-orbax/1"
META_FILE = "maverick.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def _nest(flat: Mapping[tuple[str, ...], object]) -> dict:
  out: dict = {}
  for key, value in flat.items():
    d = out
    for k in key[:-1]:
      d = d.setdefault(k, {})
    d[key[-1]] = value
  return out


def _flatten(tree: Mapping, prefix=()) -> dict[tuple[str, ...], object]:
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out.update(_flatten(v, prefix + (k,)))
    else:
      out[prefix + (k,)] = v
  return out


def _process_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    return True
  return True


class AtomicDir:
  """Writes into a temporary sibling directory, renamed into place only on success.

  An existing output is replaced only with `overwrite` and only when `is_ours(path)` says it is a
  previous output of the same kind (or it is an empty directory): never an arbitrary directory."""

  def __init__(self, out_dir: str, overwrite: bool, is_ours=None,
               what: str = f"a maverick checkpoint (no {META_FILE})"):
    is_ours = is_ours or is_orbax_checkpoint
    self.out_dir = os.path.abspath(out_dir)
    if os.path.lexists(self.out_dir):
      if not overwrite:
        raise FileExistsError(f"{self.out_dir} already exists; choose another output directory "
                              "or pass overwrite=True (--overwrite)")
      if not (is_ours(self.out_dir)
              or (os.path.isdir(self.out_dir) and not os.listdir(self.out_dir))):
        raise FileExistsError(f"{self.out_dir} exists and is not {what}; refusing to overwrite it")
    self.tmp = f"{self.out_dir}.tmp-{os.getpid()}"

  def __enter__(self):
    self.remove_stale_temporaries()
    shutil.rmtree(self.tmp, ignore_errors=True)
    os.makedirs(self.tmp)
    return self.tmp

  def remove_stale_temporaries(self) -> list[str]:
    """Removes `<out>.tmp-<pid>` left by killed runs (SIGKILL, power loss: no cleanup ran) for
    this output, saying so on stderr; one whose process still runs is another writer of the same
    output, and an error. Returns the removed paths."""
    removed = []
    for path in sorted(glob.glob(glob.escape(self.out_dir) + ".tmp-*")):
      pid = path.rsplit(".tmp-", 1)[1]
      if not pid.isdigit() or int(pid) == os.getpid():
        continue
      if _process_alive(int(pid)):
        raise FileExistsError(
            f"{path} is being written by process {pid} (another run writing {self.out_dir}); "
            f"wait for it to finish, or stop it and delete {path}")
      shutil.rmtree(path, ignore_errors=True)
      print(f"removed {path}, left by an interrupted run (process {pid} is gone)",
            file=sys.stderr)
      removed.append(path)
    return removed

  def __exit__(self, exc_type, exc, tb):
    if exc_type is not None:
      shutil.rmtree(self.tmp, ignore_errors=True)
      return False
    old = f"{self.out_dir}.old-{os.getpid()}"
    try:
      # Move the old checkpoint aside first, so a failed rename never leaves neither.
      if os.path.lexists(self.out_dir):
        os.rename(self.out_dir, old)
      os.rename(self.tmp, self.out_dir)
    except BaseException:
      shutil.rmtree(self.tmp, ignore_errors=True)
      if os.path.lexists(old) and not os.path.lexists(self.out_dir):
        os.rename(old, self.out_dir)
      raise
    shutil.rmtree(old, ignore_errors=True)
    return False


def _write(out_dir: str, cfg: config_lib.Config,
           parts: Iterable[tuple[str, dict[tuple[str, ...], object]]], *, overwrite: bool,
           extra_files: Iterable[str] = (), source: str | None = None,
           vision_config: dict | None = None) -> str:
  names = []
  with AtomicDir(out_dir, overwrite) as tmp:
    # Closed before the rename (also on failure): no orbax thread may still write into `tmp`.
    # Uncompressed: zstd would hold a compressed copy of every array in flight (measured +0.75x
    # the layer), for ~20 % less disk on BF16 weights. Same format as StandardCheckpointer's
    # (which restores it); written synchronously, one part at a time.
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))
    try:
      for part, flat in parts:
        hf.raise_if_interrupted()
        ckptr.save(os.path.join(tmp, "params", part), args=ocp.args.PyTreeSave(_nest(flat)))
        names.append(part)
        del flat  # not held while the next part is read
    finally:
      ckptr.close()
    for f in extra_files:
      shutil.copy(f, os.path.join(tmp, os.path.basename(f)))
    meta = {"format": FORMAT, "config": cfg.to_dict(), "parts": names, "source": source}
    if vision_config is not None:  # the "vision" part holds the tower (maverick.vision.model)
      meta["vision_config"] = vision_config
    with open(os.path.join(tmp, META_FILE), "w") as f:
      json.dump(meta, f, indent=1)
  return os.path.abspath(out_dir)


def host_array(x: np.ndarray):
  """A host array for orbax to save: a JAX array on the CPU that adopts `x`'s buffer (orbax copies
  a NumPy array it saves, a CPU JAX array it writes from in place), so a converted layer is in
  memory once. Without a CPU backend (JAX_PLATFORMS excludes it) `x` itself."""
  try:
    cpu = jax.devices("cpu")[0]
  except RuntimeError:
    return x
  return jax.device_put(hf.as_aligned(x, x.dtype), cpu, may_alias=True)


def _hf_parts(ckpt: hf.SafetensorsCheckpoint, cfg: config_lib.Config, dtype, progress: bool):
  """Reads HF tensors part by part (a layer at a time), yielding each finished part; in memory:
  the part being built plus the tensor being read (hf.iter_params reads the big ones by rows)."""
  order = hf.plan(ckpt, cfg)
  order.sort(key=lambda item: part_of(item[1].targets[0].path))
  current, flat = None, {}
  with tqdm(total=len(order), desc="converting", unit="tensor", disable=not progress) as bar:
    for stored, src in order:
      part = part_of(src.targets[0].path)
      if part != current and flat:
        yield current, flat
        flat = {}
      current = part
      for path, x in hf.iter_params(ckpt, cfg, dtype, order=[(stored, src)]):
        flat[part_key(path)] = host_array(x)
        del x
      bar.update(1)
    if flat:
      yield current, flat


def convert_hf_to_orbax(hf_dir: str, out_dir: str, *, dtype: str | None = None,
                        overwrite: bool = False, progress: bool = True,
                        check_finite: bool = True, activations: str | None = None,
                        kv_cache: str | None = None, vision: bool = False) -> str:
  """Converts a HF Llama 4 checkpoint directory (single or sharded safetensors) to our format.

  vision: also convert the vision tower of a multimodal checkpoint (part "vision", its config in
  maverick.json; `load_orbax(..., vision=True)` reads it); False: the text model only.

  Names, shapes and dtypes are all checked from the headers before anything is written; each
  tensor is checked for NaN/inf as it streams through (`check_finite=False` skips that).
  activations: for a ModelOpt FP8 checkpoint, "static_per_tensor" (default: its calibrated input
  scales) or "dynamic_per_token" (see hf_modelopt.plan); other checkpoints refuse it.
  kv_cache: likewise, "fp8_static" (default with kv_cache_quant_algo FP8: its k/v scales), "fp8"
  (per-token scales at run time) or "bf16" (unquantized, in the model dtype: the k/v scales are
  dropped); "bf16" is accepted for every checkpoint (the others' cache is unquantized already).
  """
  cfg = config_lib.from_hf(hf_dir, dtype=dtype)
  ckpt = hf.SafetensorsCheckpoint(hf_dir, check_finite=check_finite)
  mo = _modelopt(hf_dir, ckpt, activations, kv_cache)
  if mo is not None:
    cfg, items = hf_modelopt.plan(ckpt, cfg, mo, activations=activations, kv_cache=kv_cache)
    parts = hf_fp8.iter_parts(ckpt, items, progress=progress, place=host_array)
  elif hf_fp8.is_fp8(ckpt):  # kept in FP8; the derived quant config is recorded in maverick.json
    cfg, items = hf_fp8.plan(ckpt, cfg, hf_dir)
    parts = hf_fp8.iter_parts(ckpt, items, progress=progress, place=host_array)
  else:
    hf.plan(ckpt, cfg)  # validate everything up front
    parts = _hf_parts(ckpt, cfg, jnp.dtype(cfg.dtype), progress)
  vcfg = None
  if vision:
    vcfg = _vision_config(hf_dir, cfg)
    tower = hf_vision.tower_arrays(ckpt, vcfg)  # checked now, read after the text parts
    parts = itertools.chain(parts, _lazy_part("vision", lambda: {
        part_key(path): host_array(x) for path, x in
        (((vision_lib.PATH,) + p, x) for p, x in tower)}))
  extra = [os.path.join(hf_dir, f) for f in TOKENIZER_FILES
           if os.path.isfile(os.path.join(hf_dir, f))]
  return _write(out_dir, cfg, parts, overwrite=overwrite, extra_files=extra,
                source=os.path.abspath(hf_dir),
                vision_config=None if vcfg is None else vcfg.to_dict())


def _lazy_part(name, build):
  yield name, build()


def _vision_config(hf_dir: str, cfg: config_lib.Config):
  vcfg = hf_vision.config_of(hf_dir, cfg.dtype)
  if vcfg is None:
    raise hf.CheckpointError(f"{hf_dir} has no vision_config: it is a text-only checkpoint; "
                             "load or convert it text-only (vision=False / --text_only)")
  return vcfg


def save_orbax(model: model_lib.Llama4, out_dir: str, *, overwrite: bool = False,
               extra_files: Iterable[str] = ()) -> str:
  """Saves a live model in our format (e.g. after training)."""
  _, state = nnx.split(model)
  by_part: dict[str, dict] = {}
  for path, var in nnx.to_flat_state(state):
    by_part.setdefault(part_of(path), {})[part_key(path)] = var.get_value()
  tower = vision_lib.tower_of(model)
  return _write(out_dir, model.config, by_part.items(), overwrite=overwrite,
                extra_files=extra_files,
                vision_config=None if tower is None else tower.config.to_dict())


def is_orbax_checkpoint(path: str) -> bool:
  return os.path.isfile(os.path.join(path, META_FILE))


def read_format_json(path: str, meta_file: str, fmt: str | tuple[str, ...], what: str, fix: str
                     ) -> dict:
  """Reads the JSON that marks a directory as one of our formats, checking its format tag (`fmt`:
  the tag, or the tags this version reads)."""
  meta_path = os.path.join(path, meta_file)
  try:
    with open(meta_path) as f:
      meta = json.load(f)
  except FileNotFoundError:
    raise CheckpointError(f"{path} is not {what} (no {meta_file}); {fix}") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{meta_path} is not valid JSON ({e})") from None
  got = meta.get("format") if isinstance(meta, dict) else None
  if got not in ((fmt,) if isinstance(fmt, str) else fmt):
    raise CheckpointError(f"{meta_path}: format {got!r}, expected {fmt!r}")
  return meta


def read_meta(path: str) -> dict:
  meta = read_format_json(path, META_FILE, (FORMAT, FORMAT_V1), "a maverick checkpoint",
                          "convert a HF checkpoint with scripts/convert_hf.py")
  quant = meta.get("config", {}).get("quant") or {}
  if meta["format"] == FORMAT_V1 and quant.get("weights") is not None:
    raise CheckpointError(
        f"{path} is an FP8 checkpoint in format {FORMAT_V1!r}, whose FP8 weights are stored "
        f"(input, output); this version stores them K-major ({FORMAT!r}). Re-create it with "
        "scripts/quantize.py from its BF16 source (or load the HF FP8 checkpoint directly)")
  return meta


def _assemble(cfg: config_lib.Config, arrays: Mapping[tuple, jax.Array],
              moe_impl: str) -> model_lib.Llama4:
  graphdef, abstract = nnx.split(model_lib.abstract_model(cfg, moe_impl=moe_impl))
  flat = []
  for path, var in nnx.to_flat_state(abstract):
    flat.append((path, var.replace(value=arrays[path])))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def load_orbax(path: str, *, mesh=None, rules: sharding_lib.Rules = sharding_lib.REPLICATED,
               dtype: str | None = None, moe_impl: str = "tiles",
               vision: bool = False) -> model_lib.Llama4:
  """Restores a checkpoint part by part straight into the target shardings. vision: also its
  vision tower (replicated on a mesh), which the conversion must have included."""
  meta = read_meta(path)
  cfg = config_lib.Config.from_dict(meta["config"])
  if dtype is not None:
    cfg = cfg.replace(dtype=dtype)
  graphdef, abstract = nnx.split(model_lib.abstract_model(cfg, moe_impl=moe_impl))
  shardings = dict(nnx.to_flat_state(sharding_lib.state_shardings(abstract, mesh, rules)))
  targets: dict[str, dict] = {}
  for p, var in nnx.to_flat_state(abstract):
    sds = var.get_value()
    targets.setdefault(part_of(p), {})[part_key(p)] = jax.ShapeDtypeStruct(
        sds.shape, sds.dtype, sharding=shardings[p])
  missing = sorted(set(targets) - set(meta["parts"]))
  if missing:
    raise CheckpointError(f"{path}: parts {missing} are missing from {META_FILE}")
  ckptr = ocp.StandardCheckpointer()
  arrays = {}
  for part, flat_target in targets.items():
    part_dir = os.path.join(path, "params", part)
    if not os.path.isdir(part_dir):
      raise CheckpointError(f"{part_dir} is missing; the checkpoint is incomplete")
    restored = _flatten(ckptr.restore(part_dir, _nest(flat_target)))
    for key, value in restored.items():
      arrays[("layers", int(part[6:])) + tuple(key) if part.startswith("layer_")
             else tuple(key)] = value
  if vision:
    arrays.update(_restore_tower(path, meta, ckptr, dtype, mesh))
  ckptr.close()
  model = _assemble(cfg, {p: arrays[p] for p in weights.param_paths(cfg)}, moe_impl)
  if vision:
    vcfg = _stored_vision_config(path, meta, dtype)
    vision_lib.attach(model, hf_vision.assemble_tower(
        vcfg, {p[1:]: arrays[p] for p in arrays if p[0] == vision_lib.PATH}))
  return model


def _stored_vision_config(path: str, meta: dict, dtype: str | None):
  if "vision_config" not in meta or "vision" not in meta["parts"]:
    raise CheckpointError(f"{path} holds no vision tower (converted text-only); convert the HF "
                          "checkpoint again without --text_only, or load the HF directory")
  vcfg = vision_lib.VisionConfig.from_dict(meta["vision_config"])
  return vcfg if dtype is None else vcfg.replace(dtype=dtype)


def _restore_tower(path: str, meta: dict, ckptr, dtype: str | None, mesh):
  """{("vision", ...): array} of the stored tower, replicated over `mesh` when given."""
  vcfg = _stored_vision_config(path, meta, dtype)
  sharding = (jax.sharding.SingleDeviceSharding(jax.devices()[0]) if mesh is None else
              jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  target = {}
  for p, var in nnx.to_flat_state(nnx.split(vision_lib.abstract_tower(vcfg))[1]):
    sds = var.get_value()
    target[part_key((vision_lib.PATH,) + p)] = jax.ShapeDtypeStruct(sds.shape, sds.dtype,
                                                                   sharding=sharding)
  restored = _flatten(ckptr.restore(os.path.join(path, "params", "vision"), _nest(target)))
  return {tuple(k[:1]) + tuple(int(x) if x.isdigit() else x for x in k[1:]): v
          for k, v in restored.items()}


def iter_orbax_parts(path: str, cfg: config_lib.Config | None = None):
  """Yields (part, {key in part: array}) of a checkpoint one part (layer) at a time, restored on
  the default device: the streaming reader behind checkpoint-to-checkpoint tools."""
  meta = read_meta(path)
  cfg = cfg or config_lib.Config.from_dict(meta["config"])
  targets: dict[str, dict] = {}
  for p, sds in weights.param_paths(cfg).items():
    targets.setdefault(part_of(p), {})[part_key(p)] = jax.ShapeDtypeStruct(sds.shape, sds.dtype)
  ckptr = ocp.StandardCheckpointer()
  try:
    for part in meta["parts"]:
      if part == "vision":  # the vision tower: not a part of the text model these tools rewrite
        continue
      if part not in targets:
        raise CheckpointError(f"{path}: part {part} does not belong to its config")
      part_dir = os.path.join(path, "params", part)
      if not os.path.isdir(part_dir):
        raise CheckpointError(f"{part_dir} is missing; the checkpoint is incomplete")
      yield part, _flatten(ckptr.restore(part_dir, _nest(targets[part])))
  finally:
    ckptr.close()


def _modelopt(hf_dir: str, ckpt: hf.SafetensorsCheckpoint, activations: str | None,
              kv_cache: str | None = None):
  if kv_cache is not None and kv_cache not in quant_config.KV_CHOICES:
    raise hf.CheckpointError(f"kv_cache={kv_cache!r}: use one of {quant_config.KV_CHOICES}")
  mo = hf_modelopt.detect(hf_dir)
  if mo is None:
    hf_modelopt.check_unconfigured(ckpt, hf_dir)
  if kv_cache == quant_config.UNQUANTIZED_KV:
    kv_cache = None  # what every other checkpoint's KV cache is already
  for name, value in (("activations", activations), ("kv_cache", kv_cache)):
    if mo is None and value is not None:
      raise hf.CheckpointError(f"{name}={value!r} applies to ModelOpt FP8 checkpoints; "
                               f"{hf_dir} is not one")
  return mo


def load_hf(hf_dir: str, *, dtype: str | None = None, moe_impl: str = "tiles",
            check_finite: bool = True, activations: str | None = None,
            kv_cache: str | None = None, mesh=None, layout: str = "tp",
            vision: bool = False) -> model_lib.Llama4:
  """Loads a HF checkpoint directly (no conversion), one tensor at a time; each tensor is checked
  for NaN/inf (`check_finite=False` skips that). `activations`, `kv_cache`: see
  convert_hf_to_orbax.

  mesh: each tensor goes straight into its `layout` sharding on the mesh (every device receives
  only its slice; the host holds one tensor at a time) and the model carries the plan. Without a
  mesh the model is on the default device.

  vision: also load the vision tower of a multimodal checkpoint (`model.vision`, replicated on a
  mesh; maverick.checkpoint.hf_vision); False reads the text model only, as a text-only import."""
  cfg = config_lib.from_hf(hf_dir, dtype=dtype)
  ckpt = hf.SafetensorsCheckpoint(hf_dir, check_finite=check_finite)
  mo = _modelopt(hf_dir, ckpt, activations, kv_cache)
  if mo is not None:
    cfg, items = hf_modelopt.plan(ckpt, cfg, mo, activations=activations, kv_cache=kv_cache)
    params = hf_fp8.iter_params(ckpt, items)
  elif hf_fp8.is_fp8(ckpt):
    cfg, items = hf_fp8.plan(ckpt, cfg, hf_dir)
    params = hf_fp8.iter_params(ckpt, items)
  else:
    params = hf.iter_params(ckpt, cfg, order=hf.plan(ckpt, cfg))
  if mesh is None:
    place, plan = jax.device_put, None
  else:
    plan = sharding_lib.Plan(mesh, layout)
    sharding_lib.check_model_fits(cfg, plan)
    targets = sharding_lib.param_shardings(
        nnx.split(model_lib.abstract_model(cfg, moe_impl=moe_impl))[1], plan)
    place = lambda path, x: sharding_lib.put_from_host(x, targets[path])
  arrays = {}
  for path, x in params:
    arrays[path] = place(x) if plan is None else place(path, x)
    del x  # the host copy goes before the next tensor is read
  model = _assemble(cfg, arrays, moe_impl)
  if plan is not None:
    sharding_lib.attach_plan(model, plan)
  if vision:
    vision_lib.attach(model, hf_vision.load_tower(ckpt, _vision_config(hf_dir, cfg), mesh=mesh))
  return model


def load_orbax_sharded(path: str, mesh, layout: str = "tp", *, dtype: str | None = None,
                       moe_impl: str = "tiles", vision: bool = False) -> model_lib.Llama4:
  """Restores straight into the layout's shardings on `mesh` (a global mesh across processes after
  `sharding.initialize_distributed`: each process reads only its shards) and attaches the plan."""
  cfg = config_lib.Config.from_dict(read_meta(path)["config"])
  plan = sharding_lib.Plan(mesh, layout)
  sharding_lib.check_model_fits(cfg.replace(dtype=dtype) if dtype else cfg, plan)
  model = load_orbax(path, mesh=mesh, rules=plan.rules, dtype=dtype, moe_impl=moe_impl,
                     vision=vision)
  sharding_lib.attach_plan(model, plan)
  return model
