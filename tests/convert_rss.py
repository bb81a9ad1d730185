"""Peak host memory of an HF -> orbax conversion, measured in a fresh process.

`write_checkpoint(d)` writes a synthetic BF16 HF Llama 4 checkpoint whose single decoder layer is a
large MoE layer (~220 MB) and returns that layer's byte size. Run as a script
(`python tests/convert_rss.py HF_DIR OUT_DIR WARMUP_HF_DIR`) it imports everything, converts the
small WARMUP_HF_DIR once (orbax's thread pools and lazy imports are then in place), resets the
kernel's peak-RSS counter (/proc/self/clear_refs 5), converts HF_DIR and prints one JSON line:
{"rss_before": bytes resident just before, "peak": VmHWM bytes during the conversion}.
"""

from __future__ import annotations

import gc
import json
import os
import pathlib
import sys

import ml_dtypes
import numpy as np

BIG = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
           num_local_experts=16, intermediate_size=2048, intermediate_size_mlp=2048,
           vocab_size=512)


def config(**kw) -> dict:
  c = dict(BIG, **kw)
  return {
      "architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "dtype": "bfloat16",
      "num_hidden_layers": 1, "moe_layers": [0], "interleave_moe_layer_step": 1,
      "layer_types": ["full_attention"], "no_rope_layers": [1], "no_rope_layer_interval": 4,
      "num_experts_per_tok": 1, "attention_chunk_size": 16, "attn_scale": 0.25,
      "attn_temperature_tuning": True, "floor_scale": 8, "use_qk_norm": True,
      "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "tie_word_embeddings": False,
      "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
      "hidden_act": "silu", "attention_bias": False, **c}


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
  """Every HF tensor of the one-MoE-layer model (HF names and [out, in] layouts)."""
  D, H, K, Dh = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
  E, F, V = c["num_local_experts"], c["intermediate_size"], c["vocab_size"]
  p, f = "model.layers.0.", "model.layers.0.feed_forward."
  return {
      "model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D),
      p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
      p + "self_attn.q_proj.weight": (H * Dh, D), p + "self_attn.k_proj.weight": (K * Dh, D),
      p + "self_attn.v_proj.weight": (K * Dh, D), p + "self_attn.o_proj.weight": (D, H * Dh),
      f + "router.weight": (E, D), f + "experts.gate_up_proj": (E, D, 2 * F),
      f + "experts.down_proj": (E, F, D), f + "shared_expert.gate_proj.weight": (F, D),
      f + "shared_expert.up_proj.weight": (F, D), f + "shared_expert.down_proj.weight": (D, F)}


def write_checkpoint(d, seed: int = 0, **kw) -> int:
  """Writes the checkpoint to `d`; returns the byte size of decoder layer 0 (BF16)."""
  from safetensors.numpy import save_file
  d = pathlib.Path(d)
  d.mkdir(parents=True, exist_ok=True)
  c = config(**kw)
  (d / "config.json").write_text(json.dumps(c, indent=1))
  rng = np.random.default_rng(seed)
  tensors = {}
  for name, shape in tensor_shapes(c).items():
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= 1.0 if name.endswith("norm.weight") else 0.02
    tensors[name] = x.astype(ml_dtypes.bfloat16)
    del x
  save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
  return sum(t.nbytes for n, t in tensors.items() if n.startswith("model.layers.0."))


def _status(field: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(field + ":"):
        return int(line.split()[1]) * 1024
  raise KeyError(field)


def main(hf_dir: str, out_dir: str, warmup_dir: str) -> None:
  from maverick.checkpoint import convert_hf_to_orbax
  convert_hf_to_orbax(warmup_dir, out_dir + "-warmup", progress=False)
  gc.collect()
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS
  before = _status("VmRSS")
  convert_hf_to_orbax(hf_dir, out_dir, progress=False)
  print(json.dumps({"rss_before": before, "peak": _status("VmHWM")}))


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  main(*sys.argv[1:4])
