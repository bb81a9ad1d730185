"""Hugging Face Llama 4 vision tower tensors (``vision_model.*``, ``multi_modal_projector.*``) -> a
``maverick.vision.model.VisionTower``.

The tower stays in its stored float dtype class (BF16 in the bf16, Meta FP8 and ModelOpt checkpoints:
both FP8 formats exclude it from quantization) and is cast to the tower config's dtype. On a mesh it is
replicated (see maverick/vision/model.py for why): every device receives the whole tower.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maverick.checkpoint.hf import CheckpointError, SafetensorsCheckpoint
from maverick.vision import model as vision_lib

_t = lambda x: x.T  # nn.Linear [out, in] -> ours [in, out]
_ident = lambda x: x


def weight_map(cfg: vision_lib.VisionConfig) -> dict[str, tuple[tuple, tuple[int, ...], object]]:
  """HF tensor name -> (our state path, HF shape, transform), every tensor the tower needs."""
  D, F = cfg.hidden_size, cfg.intermediate_size
  m = {}

  def linear(name, path, din, dout, bias):
    m[name + ".weight"] = (path + ("weight",), (dout, din), _t)
    if bias:
      m[name + ".bias"] = (path + ("bias",), (dout,), _ident)

  def norm(name, path):
    m[name + ".weight"] = (path + ("weight",), (D,), _ident)
    m[name + ".bias"] = (path + ("bias",), (D,), _ident)

  v = "vision_model."
  linear(v + "patch_embedding.linear", ("patch_embed",), cfg.num_channels * cfg.patch_size ** 2, D,
         False)
  m[v + "class_embedding"] = (("class_embedding",), (D,), _ident)
  m[v + "positional_embedding_vlm"] = (("positional_embedding",), (cfg.patches + 1, D), _ident)
  norm(v + "layernorm_pre", ("pre_norm",))
  norm(v + "layernorm_post", ("post_norm",))
  for i in range(cfg.num_hidden_layers):
    p, L = f"{v}model.layers.{i}.", ("layers", i)
    norm(p + "input_layernorm", L + ("input_norm",))
    norm(p + "post_attention_layernorm", L + ("post_attn_norm",))
    for n in "qkvo":
      linear(p + f"self_attn.{n}_proj", L + ("attn", n), D, D, True)
    linear(p + "mlp.fc1", L + ("fc1",), D, F, True)
    linear(p + "mlp.fc2", L + ("fc2",), F, D, True)
  linear(v + "vision_adapter.mlp.fc1", ("adapter_fc1",), F, cfg.projector_input_dim, False)
  linear(v + "vision_adapter.mlp.fc2", ("adapter_fc2",), cfg.projector_input_dim,
         cfg.projector_output_dim, False)
  linear("multi_modal_projector.linear_1", ("projector",), cfg.vision_output_dim,
         cfg.text_hidden_size, False)
  return m


def config_of(hf_dir: str, dtype: str) -> vision_lib.VisionConfig | None:
  """The tower config of a HF checkpoint directory (config.json's vision_config; max_tiles from the
  image processor's max_patches, see `_max_patches`), or None for a text-only checkpoint."""
  with open(os.path.join(hf_dir, "config.json")) as f:
    cfg = vision_lib.from_hf(json.load(f), dtype=dtype)
  if cfg is None:
    return None
  max_patches = _max_patches(hf_dir)
  return cfg if max_patches is None else cfg.replace(max_tiles=max_patches)


def _max_patches(hf_dir: str) -> int | None:
  """The image processor's max_patches, from the file transformers (5.23) itself loads it from: the
  ``image_processor`` dict nested in processor_config.json (transformers 5 saves it there) when there is
  one, else preprocessor_config.json (older saves, the published Llama 4 repos). As in transformers, a
  nested dict without max_patches means the default (None here), preprocessor_config.json unread."""
  nested = os.path.join(hf_dir, "processor_config.json")
  if os.path.isfile(nested):
    proc = _read_json(nested)
    if isinstance(proc, dict) and "image_processor" in proc:
      image_proc = proc["image_processor"]
      if not isinstance(image_proc, dict):
        raise CheckpointError(f"{nested}: image_processor must be a JSON object (the image processor's "
                              f"settings), got {type(image_proc).__name__}; fix or delete the field")
      return _check_max_patches(image_proc, nested, "image_processor.max_patches")
  flat = os.path.join(hf_dir, "preprocessor_config.json")
  if os.path.isfile(flat):
    return _check_max_patches(_read_json(flat), flat, "max_patches")
  return None


def _read_json(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path} is not valid JSON ({e}); fix or delete the file") from None


def _check_max_patches(d, path: str, field: str) -> int | None:
  if not isinstance(d, dict):
    raise CheckpointError(f"{path} must hold a JSON object, got {type(d).__name__}")
  v = d.get("max_patches")
  if v is None:
    return None
  if isinstance(v, bool) or not isinstance(v, int) or v < 1:
    raise CheckpointError(f"{path}: {field} must be a positive integer (the most tiles per image; "
                          f"Llama 4 uses 16), got {v!r}; fix the field or delete it for the default")
  return v


def has_tower(ckpt: SafetensorsCheckpoint) -> bool:
  return any(_strip(n).startswith("vision_model.") for n in ckpt.tensors)


def _strip(name: str) -> str:
  # HF >= 4.5x nests the multimodal model under `model.` (`model.vision_model.*`) in some saves
  return name[len("model."):] if name.startswith(("model.vision_model.",
                                                  "model.multi_modal_projector.")) else name


def tower_arrays(ckpt: SafetensorsCheckpoint, cfg: vision_lib.VisionConfig):
  """(our state path, host array in cfg.dtype) for every tower tensor, read one at a time, after
  checking every name, shape and dtype against `cfg` from the headers (here, before any read)."""
  wmap = weight_map(cfg)
  stored = {_strip(n): n for n in ckpt.tensors
            if _strip(n).startswith(("vision_model.", "multi_modal_projector."))}
  missing = sorted(set(wmap) - set(stored))
  extra = sorted(set(stored) - set(wmap))
  if missing or extra:
    raise CheckpointError(f"{ckpt.directory}: the vision tower does not match its vision_config: "
                          f"missing tensors {missing[:5]}, unexpected tensors {extra[:5]}; load it "
                          "text-only (vision=False / --text_only) or fix config.json")
  for name, (path, shape, _) in wmap.items():
    info = ckpt.tensors[stored[name]]
    if tuple(info.shape) != shape:
      raise CheckpointError(f"{ckpt.directory}: tensor {stored[name]} has shape {tuple(info.shape)}, "
                            f"the vision_config needs {shape}")
    if info.dtype not in ("F32", "BF16", "F16"):
      raise CheckpointError(f"tensor {stored[name]} has dtype {info.dtype}: the vision tower is read "
                            "in a float dtype (FP8 checkpoints keep it in BF16)")
  dt = jnp.dtype(cfg.dtype)
  # checked above, read lazily below: one tensor in memory at a time
  return ((path, np.ascontiguousarray(transform(ckpt.read(stored[name]))).astype(dt))
          for name, (path, _, transform) in wmap.items())


def assemble_tower(cfg: vision_lib.VisionConfig, arrays, *, mesh=None) -> vision_lib.VisionTower:
  """A tower from {state path: array} (every parameter), on the default device or replicated over
  `mesh`."""
  graphdef, state = nnx.split(vision_lib.abstract_tower(cfg))
  place = (jax.device_put if mesh is None else
           lambda x: jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
  flat = [(path, var.replace(value=place(arrays[path])))
          for path, var in nnx.to_flat_state(state)]
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def load_tower(ckpt: SafetensorsCheckpoint, cfg: vision_lib.VisionConfig, *,
               mesh=None) -> vision_lib.VisionTower:
  """Reads the tower's tensors (shapes checked against `cfg`, names both ways) into a tower, on
  the default device or replicated over `mesh`."""
  return assemble_tower(cfg, dict(tower_arrays(ckpt, cfg)), mesh=mesh)
