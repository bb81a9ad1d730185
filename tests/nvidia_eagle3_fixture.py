"""Writes a tiny EAGLE-3 head in NVIDIA's (ModelOpt Megatron export) layout, for tests/fixtures/
hf_llama4_tiny (hidden 64, 4/2 heads of 32, vocab 512, 8 layers).

What it imitates (spec_decode/nvidia_eagle3.py lists the sources): config.json started from a Llama
3.1 one (architectures LlamaForCausalLMEagle3, model_type llama, llama3 rope_scaling, a rope_theta
of its own), an `eagle_config` block with the keys unified_export_megatron.py writes, an
hf_quant_config.json with quant_algo null, and model.safetensors with `midlayer.*` (or
`layers.0.*`) names, `fc.weight` [D, 3D], `lm_head.weight`, optional `d2t`, no `embed_tokens`.

Weights are seeded random (norm weights away from 1, so a swapped norm shows). Run as a script to
write one: `python tests/nvidia_eagle3_fixture.py OUT_DIR [--layers0] [--d2t]`.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np
from safetensors.numpy import save_file

V, D, H, KV, DH, F = 512, 64, 4, 2, 32, 80  # F: the draft's own MLP width (the target's is 96)
VD = 200  # reduced draft vocabulary when a d2t map is written
AUX = [1, 3, 4]  # TensorRT-LLM's (1, N//2 - 1, N - 4) for the 8-layer target


def nvidia_config(*, draft_vocab: int = V) -> dict:
  return {
      "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
      "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None,
      "eos_token_id": None, "pad_token_id": None, "sep_token_id": None, "head_dim": DH,
      "hidden_act": "silu", "hidden_size": D, "initializer_range": 0.02, "intermediate_size": F,
      "max_position_embeddings": 4096, "mlp_bias": False, "num_attention_heads": H,
      "num_hidden_layers": 1, "num_key_value_heads": KV, "pretraining_tp": 1,
      "rms_norm_eps": 1e-5,
      # Not the target's (500000, factor 8, original 32): the draft must use its own.
      "rope_scaling": {"factor": 4.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                       "original_max_position_embeddings": 64, "rope_type": "llama3"},
      "rope_theta": 20000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
      "transformers_version": "4.51.0", "use_cache": True, "vocab_size": V,
      "draft_vocab_size": draft_vocab,
      "eagle_config": {
          "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
          "use_mtp_layernorm": False, "use_aux_hidden_state": True,
          "eagle_aux_hidden_state_layer_ids": list(AUX), "next_layer_regular": True,
          "parallel_draft_step": 1, "parallel_draft_heads_num_layers": 1,
      },
  }


QUANT_CONFIG = {"producer": {"name": "modelopt", "version": "0.29.0"},
                "quantization": {"quant_algo": None, "kv_cache_quant_algo": None}}


def nvidia_tensors(*, seed: int = 0, d2t: bool = False, lm_head: bool = True,
                   prefix: str = "midlayer.") -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
  g = lambda: (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
  m = prefix
  t = {
      "fc.weight": w(D, 3 * D),
      m + "input_layernorm.weight": g(), m + "hidden_norm.weight": g(),
      m + "self_attn.q_proj.weight": w(H * DH, 2 * D),
      m + "self_attn.k_proj.weight": w(KV * DH, 2 * D),
      m + "self_attn.v_proj.weight": w(KV * DH, 2 * D),
      m + "self_attn.o_proj.weight": w(D, H * DH),
      m + "post_attention_layernorm.weight": g(),
      m + "mlp.gate_proj.weight": w(F, D), m + "mlp.up_proj.weight": w(F, D),
      m + "mlp.down_proj.weight": w(D, F),
      "norm.weight": g(),
  }
  vd = VD if d2t else V
  if lm_head:
    t["lm_head.weight"] = (3 * w(vd, D)).astype(np.float32)
  if d2t:
    used = np.sort(rng.choice(V, VD, replace=False))
    t["d2t"] = (used - np.arange(VD)).astype(np.int64)  # offsets: target id = i + d2t[i]
  return t


def write_head(out: pathlib.Path, *, seed: int = 0, d2t: bool = False, lm_head: bool = True,
               prefix: str = "midlayer.", config_edit=None) -> tuple[dict, dict]:
  """Writes config.json, hf_quant_config.json and model.safetensors; returns (config, tensors)."""
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  cfg = nvidia_config(draft_vocab=VD if d2t else V)
  if config_edit is not None:
    config_edit(cfg)
  tensors = nvidia_tensors(seed=seed, d2t=d2t, lm_head=lm_head, prefix=prefix)
  (out / "config.json").write_text(json.dumps(cfg, indent=2))
  (out / "hf_quant_config.json").write_text(json.dumps(QUANT_CONFIG, indent=4))
  save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
  return cfg, tensors


if __name__ == "__main__":
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("out")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--d2t", action="store_true", help="reduced vocabulary with a d2t map")
  ap.add_argument("--layers0", action="store_true", help="`layers.0.` names (speculators)")
  a = ap.parse_args()
  write_head(pathlib.Path(a.out), seed=a.seed, d2t=a.d2t,
             prefix="layers.0." if a.layers0 else "midlayer.")
