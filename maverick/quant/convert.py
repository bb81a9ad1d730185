"""Whole-model FP8 conversion: a live model, or a checkpoint streamed one layer at a time.

Which weights become FP8, and over which axes each is contracted, comes from the model's own
declarations (`maverick.model.linear_weight` tags each FP8 weight with `fp8_in_axes`; read through
maverick.weights), so nothing here knows layer structure. FP8 weights are stored K-major
(`to_kmajor`); BF16 ones as declared.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm import tqdm

from maverick import config as config_lib
from maverick import model as model_lib
from maverick.checkpoint import hf, store
from maverick.checkpoint import parts as parts_lib
from maverick.quant.config import QuantConfig
from maverick.quant.ops import (FP8, QuantError, dequantize, from_kmajor, quantize_weight,
                                to_kmajor)
from maverick.weights import fp8_declarations, scale_path


@functools.partial(jax.jit, static_argnums=1)
def _quantize(w, in_axes):
  q, scale = quantize_weight(w, in_axes)
  return to_kmajor(q, in_axes), scale


@functools.partial(jax.jit, static_argnums=(2, 3))
def _dequantize(q_kmajor, scale, in_axes, dtype):
  n = len(in_axes)
  stored_in = tuple(range(q_kmajor.ndim - n, q_kmajor.ndim))
  return from_kmajor(dequantize(q_kmajor, scale, stored_in, dtype), in_axes)


def _check_finite(name: str, x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == FP8:
    return
  bad = int(jnp.sum(~jnp.isfinite(x)))
  if bad:
    raise QuantError(f"weight {name} has {bad} NaN/inf value(s) out of {x.size}; fix the "
                     "checkpoint (or retrain) before quantizing: a scale cannot represent them")


def _moe_impl(model) -> str:
  for layer in model.layers:
    if hasattr(layer.ffn, "impl"):
      return layer.ffn.impl
  return "tiles"


def _assemble(cfg, arrays, moe_impl):
  graphdef, abstract = nnx.split(model_lib.abstract_model(cfg, moe_impl=moe_impl))
  flat = [(p, v.replace(value=arrays[p])) for p, v in nnx.to_flat_state(abstract)]
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def quantize_params(flat: dict, fp8: dict[tuple, tuple], *, name) -> dict:
  """{path: array} -> the same with every path in `fp8` replaced by its e4m3 weight (K-major) and
  scale; `name(path)` names a weight in errors."""
  out = {}
  for p, x in flat.items():
    if p in fp8:
      _check_finite(name(p), x)
      out[p], out[scale_path(p)] = _quantize(x, fp8[p])
    else:
      out[p] = x
  return out


def _refuse_static(quant: QuantConfig) -> None:
  if quant.static_activations:
    raise QuantError("activations 'static_per_tensor' need calibrated input scales, which "
                     "quantization from BF16 does not compute; use 'dynamic_per_token' (or load "
                     "a ModelOpt FP8 checkpoint, which carries its scales)")
  if quant.static_kv:
    raise QuantError("kv_cache 'fp8_static' needs calibrated per-layer K/V scales, which "
                     "quantization from BF16 does not compute; use kv_cache 'fp8' (per-token "
                     "scales at run time) or load a ModelOpt FP8 checkpoint, which carries them")


def _dotted(path) -> str:
  return ".".join(str(k) for k in path)


def quantize_model(model: model_lib.Llama4, quant: QuantConfig | None = None, *,
                   moe_impl: str | None = None) -> model_lib.Llama4:
  """A new model with `quant` (default QuantConfig()): weights quantized per output channel,
  everything else shared with `model`. NaN/inf weights raise QuantError naming the weight."""
  quant = quant or QuantConfig()
  _refuse_static(quant)
  cfg = model.config
  if cfg.quant is not None and cfg.quant.weights is not None:
    raise QuantError("the model is already quantized (config.quant.weights is set); quantize "
                     "its BF16 original, or dequantize_model(...) first")
  impl = moe_impl or _moe_impl(model)
  new_cfg = cfg.replace(quant=quant)
  flat = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.split(model)[1])}
  arrays = quantize_params(flat, fp8_declarations(new_cfg, impl), name=_dotted)
  return _assemble(new_cfg, arrays, impl)


def dequantize_model(model: model_lib.Llama4, dtype: str | None = None, *,
                     moe_impl: str | None = None) -> model_lib.Llama4:
  """The unquantized model with weights `float(q) * scale` in `dtype` (default: the model's): the
  reference an FP8 model is compared against. Drops all quantization, the KV cache's included."""
  cfg = model.config
  impl = moe_impl or _moe_impl(model)
  fp8 = fp8_declarations(cfg, impl) if cfg.quant is not None else {}
  new_cfg = cfg.replace(quant=None, dtype=dtype or cfg.dtype)
  flat = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.split(model)[1])}
  arrays = {}
  for p, x in flat.items():
    if p in fp8:
      arrays[p] = _dequantize(x, flat[scale_path(p)], fp8[p], jnp.dtype(new_cfg.dtype))
    elif p[-1].endswith("_scale") and p[:-1] + (p[-1][:-len("_scale")],) in fp8:
      continue
    elif p[-1].endswith("_input_scale") and p[:-1] + (p[-1][:-len("_input_scale")],) in fp8:
      continue  # static activation scales: dropped with the quantization
    elif p[-1] in model_lib.KV_CACHE_SCALES:
      continue  # static KV-cache scales: likewise
    else:
      arrays[p] = x.astype(new_cfg.dtype)
  return _assemble(new_cfg, arrays, impl)


def quantize_checkpoint(src: str, out_dir: str, quant: QuantConfig | None = None, *,
                        overwrite: bool = False, progress: bool = True) -> str:
  """BF16 checkpoint -> FP8 checkpoint, one layer in memory at a time.

  `src`: one of our checkpoints (maverick.json) or a Hugging Face BF16 directory. The output is our
  format with `quant` recorded in maverick.json's config; it is written to a temporary sibling and
  renamed into place only when complete (NaN/inf weights abort with nothing written).
  """
  quant = quant or QuantConfig()
  _refuse_static(quant)
  if store.is_orbax_checkpoint(src):
    cfg = config_lib.Config.from_dict(store.read_meta(src)["config"])
    parts: Iterable = store.iter_orbax_parts(src, cfg)
    n_parts = len(store.read_meta(src)["parts"])
  elif os.path.isfile(os.path.join(src, "config.json")):
    cfg = config_lib.from_hf(src)
    ckpt = hf.SafetensorsCheckpoint(src)
    hf.plan(ckpt, cfg)  # validate names, shapes, dtypes before writing anything
    parts = store._hf_parts(ckpt, cfg, jnp.dtype(cfg.dtype), progress=False)
    n_parts = cfg.num_hidden_layers + 2
  else:
    raise FileNotFoundError(f"{src} is neither a maverick checkpoint ({store.META_FILE}) nor a "
                            "Hugging Face directory (config.json)")
  if cfg.quant is not None and cfg.quant.weights is not None:
    raise QuantError(f"{src} is already an FP8 checkpoint (quant {cfg.quant.to_dict()})")
  new_cfg = cfg.replace(quant=quant)
  fp8 = fp8_declarations(new_cfg)

  def quantized_parts():
    for part, flat in tqdm(parts, total=n_parts, desc="quantizing", unit="part",
                           disable=not progress):
      full = {parts_lib.full_path(part, k): v for k, v in flat.items()}
      q = quantize_params(full, fp8, name=_dotted)
      yield part, {parts_lib.part_key(p): v for p, v in q.items()}

  extra = [os.path.join(src, f) for f in store.TOKENIZER_FILES
           if os.path.isfile(os.path.join(src, f))]
  return store._write(out_dir, new_cfg, quantized_parts(), overwrite=overwrite,
                      extra_files=extra, source=os.path.abspath(src))


