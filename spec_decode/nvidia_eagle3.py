"""NVIDIA's EAGLE-3 head layout (ModelOpt export): every flag and side file checked, none ignored.

`spec_decode.checkpoint.import_eagle3` reads the tensors; this module decides, from config.json and
hf_quant_config.json alone, whether the head is one we compute exactly. A flag either has a value
we implement or the import stops with a DraftConfigError / CheckpointError naming the file, the
flag, its value and what to do.

Facts, and where they were read (repository paths; not copied, re-derived):
  Tensor names. ModelOpt `modelopt/torch/export/plugins/mcore_llama.py` (Megatron export rules for
    LlamaForCausalLMEagle3): `enorm` -> `midlayer.input_layernorm.` (the norm of the TOKEN
    EMBEDDING), the first layer's own input norm -> `midlayer.hidden_norm.` (the norm of fc's
    output), `fc.`, `norm.`, `d2t`, `lm_head.`. The HF-side exporter
    `modelopt/torch/export/plugins/hf_spec_export.py` maps the same names (`input_embeds_norm` ->
    `midlayer.input_layernorm`, `eagle_lm_head` -> `lm_head`, optional `d2t`; no `t2d`, no
    `embed_tokens`) and writes `lm_head.weight` from the base model when the head has none.
    TensorRT-LLM `tensorrt_llm/_torch/models/modeling_speculative.py` (`Eagle3ForCausalLM.
    load_weights`) renames `layers.0.` -> `midlayer.`; vLLM
    `vllm/model_executor/models/llama_eagle3.py` renames `midlayer.` -> `layers.0.`.
  Dataflow. TensorRT-LLM `Eagle3DecoderLayer.forward`: residual = hidden (un-normed),
    x = [input_layernorm(embeds); hidden_norm(hidden)], attention, the residual add fused into
    post_attention_layernorm, SwiGLU; `Eagle3DraftModel.forward`: `norm(hidden, residual)` gives
    the logits input and the PRE-norm sum, which is carried to the next draft step. ModelOpt
    `modelopt/torch/speculative/plugins/megatron_eagle.py` (EagleModule.forward): the same order,
    [enorm(embeddings); input_layernorm(h)], residual un-normed.
  RoPE. TensorRT-LLM `Eagle3Attention`: `PositionEmbeddingType.rope_gpt_neox` (rotate-half), with
    `RopeParams.from_config(draft config)`; ModelOpt megatron_eagle.py: the draft's own
    RotaryEmbedding(rotary_interleaved=False, rotary_base=<draft rope_theta>, rope_scaling from the
    draft config). ModelOpt `modelopt/torch/export/unified_export_megatron.py` starts the exported
    config.json from `nvidia/Llama-3.1-8B-Instruct-FP8`'s, so rope_theta / rope_scaling are Llama
    3.1's (500000, llama3 factor 8) unless overridden: read from the draft's config, never the
    target's. Only "default" and "llama3" are implemented (maverick.config._read_rope).
  eagle_config block. unified_export_megatron.py writes use_input_layernorm_in_first_layer,
    use_last_layernorm, use_mtp_layernorm, use_aux_hidden_state, eagle_aux_hidden_state_layer_ids,
    next_layer_regular (true), parallel_draft_step, parallel_draft_heads_num_layers;
    hf_spec_export.py writes the first five. EAGLE-3 defaults (ModelOpt
    `modelopt/torch/speculative/config.py`, EAGLE3_DEFAULT_CFG): use_aux_hidden_state true,
    use_input_layernorm_in_first_layer true, use_last_layernorm true, use_mtp_layernorm false.
    TensorRT-LLM also reads eagle_config.{eh_proj_before_attn, eh_proj_bias, norm_before_fc,
    return_hidden_post_norm, next_layer_regular} and top-level fc_norm / norm_output.
  norm_before_residual. vLLM llama_eagle3.py `_norm_before_residual`: residual = hidden_norm(h)
    instead of h. Implemented (Eagle3Config.norm_before_residual); NVIDIA's head leaves it off.
  hf_quant_config.json. ModelOpt `modelopt/torch/export/quant_utils.py` writes
    {"producer": {...}, "quantization": {"quant_algo": null, "kv_cache_quant_algo": null}} for an
    unquantized model; a null quant_algo is ignored, anything else is refused (we read float
    weights only).
  Aux layers. TensorRT-LLM `tensorrt_llm/_torch/speculative/eagle3.py`: layers_to_capture =
    (1, N//2 - 1, N - 4), OUTPUTS of 0-indexed layers ([1, 23, 44] for Maverick's 48);
    spec_decode.draft.default_aux_layers, and maverick.model captures the residual stream after
    each layer (tests/test_model.py::test_capture_layers_are_residual_stream checks it against
    HF's hidden_states[i + 1]). Order: ModelOpt's HF exporter writes the ids as list(set(ids))
    ([1, 44, 23] for Maverick) while its training concatenates the features its forward hooks
    collect, in layer order, and TensorRT-LLM sorts the ids; Eagle3Config sorts them too.
  Embedding. TensorRT-LLM shares the target's embed_tokens when the head's hidden size equals the
    target's (Eagle3DraftModel: `self.embed_tokens = None`, `load_weights_from_target_model`).
    Our draft always embeds with the table the caller passes (the target's).

Unconfirmed without NVIDIA's real files: the exact values in nvidia/Llama-4-Maverick-17B-128E-
Eagle3's config.json (rope_theta / rope_scaling, intermediate size, whether eagle_config carries
the Megatron-only keys) and whether its safetensors hold `d2t` / `lm_head.weight`. The importer
accepts every combination the sources allow and refuses the rest.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from maverick.checkpoint.hf import CheckpointError
from spec_decode.draft import DraftConfigError

QUANT_FILE = "hf_quant_config.json"

# eagle_config keys -> the values we implement (ModelOpt / TensorRT-LLM meaning in the docstring).
# A key not listed here is refused: it may change the computation in a way we do not know.
_EAGLE_FLAGS: dict[str, tuple[Any, str]] = {
    "use_aux_hidden_state": (True, "false is an EAGLE-1/2 draft (fc over [embedding; hidden])"),
    "use_input_layernorm_in_first_layer": (True, "false drops the embedding norm "
                                           "(midlayer.input_layernorm)"),
    "use_last_layernorm": (True, "false takes logits from the un-normed output (no norm.weight)"),
    "use_mtp_layernorm": (False, "true is ModelOpt's MTP-style enorm/hnorm variant"),
    "parallel_draft_step": (1, "values > 1 are ModelOpt's parallel-draft heads"),
    "eh_proj_before_attn": (False, "true is TensorRT-LLM's eh_proj variant"),
    "eh_proj_bias": (False, "true belongs to the eh_proj variant"),
    "norm_before_fc": (False, "true norms the 3 target features before fc"),
    "return_hidden_post_norm": (False, "true carries the POST-norm hidden to the next step"),
    "eagle_disable_moe": (True, "false would put a MoE block in the draft layer"),
}
# Keys with no effect on a single-layer head's forward (any value accepted).
_EAGLE_INERT = {
    "eagle_aux_hidden_state_layer_ids": "read by checkpoint.eagle3_config_from_hf",
    "next_layer_regular": "only shapes layers after the first; the head has one",
    "parallel_draft_heads_num_layers": "only used when parallel_draft_step > 1",
    "has_lm_head": "the tensors decide: lm_head.weight, else the target's head",
    "draft_vocab_size": "checked against the top-level draft_vocab_size",
    "eagle_hidden_state_distillation": "a training loss option",
    "num_hidden_layers": "checked with the top-level num_hidden_layers",
    "eagle_num_layers": "checked with the top-level num_hidden_layers",
}
# Top-level config.json keys of known draft variants -> the value we implement.
_TOP_FLAGS: dict[str, tuple[Any, str]] = {
    "use_aux_hidden_state": (True, "false is an EAGLE-1/2 draft (fc over [embedding; hidden])"),
    "fc_norm": (False, "true norms each target feature before fc (gpt-oss v3 drafts)"),
    "norm_before_fc": (False, "true norms the 3 target features before fc"),
    "norm_output": (False, "true carries the POST-norm hidden to the next step"),
    "eh_proj_before_attn": (False, "true is TensorRT-LLM's eh_proj variant"),
    "return_hidden_post_norm": (False, "true carries the POST-norm hidden to the next step"),
    "attention_bias": (False, "the draft layer has no biases"),
    "mlp_bias": (False, "the draft layer has no biases"),
    "bias": (False, "fc / attention biases (TensorRT-LLM, vLLM) are not implemented"),
    "qkv_bias": (False, "the draft layer has no biases"),
    "tie_word_embeddings": (False, "true would make lm_head the embedding table"),
    "logit_scale": (1.0, "vLLM scales logits by it"),
    "use_mtp_layernorm": (False, "true is ModelOpt's MTP-style enorm/hnorm variant"),
    "parallel_draft_step": (1, "values > 1 are ModelOpt's parallel-draft heads"),
}


def _same(value, want) -> bool:
  """JSON value == the implemented value (0/1 count as booleans, as HF configs sometimes hold)."""
  if isinstance(want, bool):
    return isinstance(value, (bool, int)) and value in (0, 1) and bool(value) == want
  return isinstance(value, (int, float)) and not isinstance(value, bool) and value == want


def check_flags(raw: Mapping[str, Any], where: str) -> bool:
  """Checks every variant flag of a draft config.json; returns norm_before_residual.

  Raises DraftConfigError naming the flag, its value, the value we implement and why it matters.
  """
  eagle = raw.get("eagle_config")
  if eagle is None:
    eagle = {}
  if not isinstance(eagle, dict):
    raise DraftConfigError(f"{where}: eagle_config must be an object, got {eagle!r}")
  unknown = sorted(set(eagle) - set(_EAGLE_FLAGS) - set(_EAGLE_INERT))
  if unknown:
    raise DraftConfigError(
        f"{where}: eagle_config.{unknown[0]} = {eagle[unknown[0]]!r} is not a flag this importer "
        f"knows (known: {sorted(set(_EAGLE_FLAGS) | set(_EAGLE_INERT))}); it may change the "
        "draft's forward, so the import stops rather than ignore it")
  for table, prefix, src in ((_EAGLE_FLAGS, "eagle_config.", eagle), (_TOP_FLAGS, "", raw)):
    for key, (want, why) in table.items():
      v = src.get(key)
      if v is None or _same(v, want):
        continue
      shown = "true" if v is True else "false" if v is False else repr(v)
      raise DraftConfigError(
          f"{where}: {prefix}{key} = {shown} is not supported: only {json.dumps(want)} is "
          f"implemented ({why}); use a head exported with {prefix}{key}={json.dumps(want)}")
  for key in ("num_hidden_layers", "eagle_num_layers"):
    if eagle.get(key) not in (None, 1):
      raise DraftConfigError(f"{where}: eagle_config.{key} = {eagle[key]!r}; only single-layer "
                             "EAGLE-3 drafts are supported")
  dv = eagle.get("draft_vocab_size")
  top = raw.get("draft_vocab_size") or raw.get("vocab_size")
  if dv not in (None, 0) and dv != top:  # ModelOpt: 0 means "the base model's vocabulary"
    raise DraftConfigError(f"{where}: eagle_config.draft_vocab_size = {dv!r} contradicts "
                           f"draft_vocab_size = {top!r}")
  nbr = raw.get("norm_before_residual", eagle.get("norm_before_residual", False))
  if nbr is None:
    nbr = False
  if not isinstance(nbr, bool):
    raise DraftConfigError(f"{where}: norm_before_residual must be true or false, got {nbr!r}")
  return nbr


def check_quant_config(directory: str) -> None:
  """hf_quant_config.json beside the weights: a null quant_algo (NVIDIA's bf16 head ships one)
  is ignored; a quantized head is refused, since its tensors would be read as plain floats."""
  path = os.path.join(directory, QUANT_FILE)
  if not os.path.isfile(path):
    return
  try:
    with open(path) as f:
      raw = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{path} is not valid JSON ({e}); re-download or fix it") from None
  if not isinstance(raw, dict):
    raise CheckpointError(f"{path}: expected a JSON object at the top level")
  # ModelOpt nests the fields under "quantization"; older TensorRT-LLM quant configs are flat.
  section = raw.get("quantization", raw)
  prefix = "quantization." if "quantization" in raw else ""
  if not isinstance(section, dict):
    raise CheckpointError(f"{path}: quantization must be an object, got {section!r}")
  for key in ("quant_algo", "kv_cache_quant_algo"):
    v = section.get(key)
    if v is not None:
      raise CheckpointError(
          f"{path}: {prefix}{key} = {v!r}: quantized EAGLE-3 heads are not supported (only "
          "unquantized bf16/fp16/fp32 weights are read); use an unquantized export of the head "
          "(NVIDIA's bf16 head has quant_algo null)")


def check_config_quantization(raw: Mapping[str, Any], where: str) -> None:
  """A `quantization_config` in config.json (HF-style quantized export) is refused as well."""
  qc = raw.get("quantization_config")
  if qc:
    method = qc.get("quant_method", qc.get("quant_algo")) if isinstance(qc, dict) else qc
    raise DraftConfigError(f"{where}: quantization_config ({method!r}) is set: quantized EAGLE-3 "
                           "heads are not supported; use an unquantized export of the head")
