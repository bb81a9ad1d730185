"""Write tests/fixtures/hf_llama4_mm_tiny/: a tiny random HF ``Llama4ForConditionalGeneration`` and its outputs.

A side tool, never imported by the tests (needs torch + transformers, see tools/make_vision_fixture.py):

  /work/venvhf/bin/python tools/make_multimodal_fixture.py

The text part has the scale of tests/fixtures/hf_llama4_tiny (hidden 64, 4 heads / 2 KV, head_dim 32,
MoE on odd layers, chunk 16, a NoPE layer with temperature tuning, QK norm, llama3 RoPE) with 4 layers;
the vision part has 56-px tiles, patch 14 (16 patches + CLS per tile, 4 ``<|patch|>`` tokens after the
pixel shuffle), hidden 32, 2 heads, 2 layers. Weights are drawn with a fixed seed at scales that keep
every part of the output meaningful (norm weights and biases not at 1/0). Per case (one image; two
images of other sizes and aspect ratios) it saves the prompt ids (HF's own layout,
``Llama4Processor.replace_image_token``), the pixel values (HF's processor, bfloat16 values stored as
float32), the projected image features, the prompt logits and 20 greedy tokens from ``generate``.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
import transformers
from PIL import Image
from safetensors.torch import save_file
from transformers import Llama4Config, Llama4ForConditionalGeneration
from transformers.models.llama4.image_processing_llama4 import Llama4ImageProcessor
from transformers.models.llama4.processing_llama4 import Llama4Processor

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "hf_llama4_mm_tiny"
SEED = 7
TILE, MAX_TILES = 56, 4
# the image special tokens, at the top of the tiny vocabulary (Maverick: 200080.. in 202048)
SPECIAL = {"<|image_start|>": 500, "<|image_end|>": 501, "<|image|>": 502, "<|patch|>": 503,
           "<|tile_x_separator|>": 504, "<|tile_y_separator|>": 505}
# (case name, [(image height, width, seed)], text before/between/after the images)
CASES = [
  ("one_image", [(100, 80, 11)], [9, 3]),
  ("two_images", [(40, 130, 12), (50, 50, 13)], [5, 4, 6]),
]


def text_config():
  return dict(
    vocab_size=512, hidden_size=64, intermediate_size=48, intermediate_size_mlp=96,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2,
    attention_chunk_size=16, no_rope_layer_interval=4, attn_temperature_tuning=True, floor_scale=8,
    attn_scale=0.25, use_qk_norm=True, rms_norm_eps=1e-5, max_position_embeddings=4096,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 32},
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def vision_config():
  # intermediate_size = 4 * hidden: HF's adapter fc1 reads the pixel-shuffled width through it
  return dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
              image_size=TILE, patch_size=14, num_channels=3, pixel_shuffle_ratio=0.5,
              projector_input_dim=48, projector_output_dim=48, vision_output_dim=48, norm_eps=1e-5,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
  """Fixed-seed weights: norm weights 1 + 0.1 N, biases 0.1 N, routers 0.15 N, lm_head 0.3 N, text
  weights 0.05 N (as the text fixture), vision weights N / sqrt(fan in), embeddings 0.5 N."""
  with torch.no_grad():
    for name, p in sorted(model.named_parameters()):
      n = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if "norm" in name and name.endswith("weight"):
        v = 1.0 + 0.1 * n
      elif name.endswith("bias"):
        v = 0.1 * n
      elif "router" in name:
        v = 0.15 * n
      elif "lm_head" in name:
        v = 0.3 * n
      elif "language_model" in name:
        v = 0.05 * n
      elif "class_embedding" in name or "positional_embedding" in name:
        v = 0.5 * n
      else:
        v = n / np.sqrt(p.shape[-1])
      p.copy_(v)


def synthetic(h, w, seed):
  rng = np.random.default_rng(seed)
  yy, xx = np.meshgrid(np.linspace(0, 1, h), np.linspace(0, 1, w), indexing="ij")
  base = np.stack([np.sin(3 * xx + c) * np.cos(5 * yy - c) for c in range(3)], -1)
  noise = rng.integers(-40, 41, (h, w, 3))
  return np.clip(np.round(127.5 + 90 * base + noise), 0, 255).astype(np.uint8)


def layout(pv, aspect):
  p = Llama4Processor.__new__(Llama4Processor)
  p.patch_size, p.downsample_ratio = 14, 4
  text = p.replace_image_token({"pixel_values": pv, "aspect_ratios": aspect}, 0)
  ids, i = [], 0
  while i < len(text):  # the layout is special tokens only
    for tok, t in SPECIAL.items():
      if text.startswith(tok, i):
        ids.append(t)
        i += len(tok)
        break
    else:
      raise ValueError(text[i:i + 30])
  return ids


def main():
  torch.manual_seed(SEED)
  cfg = Llama4Config(text_config=text_config(), vision_config=vision_config(),
                     boi_token_index=SPECIAL["<|image_start|>"],
                     eoi_token_index=SPECIAL["<|image_end|>"],
                     image_token_index=SPECIAL["<|patch|>"], tie_word_embeddings=False)
  cfg.text_config._attn_implementation = "eager"
  model = Llama4ForConditionalGeneration(cfg).float().eval()
  gen = torch.Generator().manual_seed(SEED)
  randomize(model, gen)
  OUT.mkdir(parents=True, exist_ok=True)
  for f in OUT.glob("*"):
    f.unlink()
  model.save_pretrained(OUT, safe_serialization=True)
  (OUT / "generation_config.json").unlink(missing_ok=True)
  proc = Llama4ImageProcessor(size={"height": TILE, "width": TILE}, max_patches=MAX_TILES)
  rng = np.random.default_rng(SEED)
  meta = {"transformers": transformers.__version__, "torch": torch.__version__, "seed": SEED,
          "tile_size": TILE, "max_tiles": MAX_TILES, "special_tokens": SPECIAL, "cases": []}
  arrays = {}
  for name, images, texts in CASES:
    ids = list(rng.integers(0, 500, texts[0]))
    pvs, grids = [], []
    for k, (h, w, seed) in enumerate(images):
      arr = synthetic(h, w, seed)
      Image.fromarray(arr).save(OUT / f"{name}_{k}.png")
      out = proc(images=[Image.fromarray(arr)], return_tensors="pt")
      pvs.append(out["pixel_values"])
      grids.append([int(v) for v in out["aspect_ratios"][0]])
      ids += layout(out["pixel_values"], out["aspect_ratios"])
      ids += list(rng.integers(0, 500, texts[k + 1]))
    pv = torch.cat(pvs).float()
    input_ids = torch.tensor([ids], dtype=torch.long)
    with torch.no_grad():
      feats = model.get_image_features(pixel_values=pv, return_dict=True).last_hidden_state
      proj = model.multi_modal_projector(feats.reshape(-1, feats.shape[-1]))
      logits = model(input_ids=input_ids, pixel_values=pv).logits[0]
      greedy = model.generate(input_ids=input_ids, pixel_values=pv, max_new_tokens=20,
                              do_sample=False, min_new_tokens=20)[0, len(ids):]
    arrays[f"{name}.input_ids"] = np.asarray(ids, np.int32)
    arrays[f"{name}.pixel_values"] = pv.numpy()
    arrays[f"{name}.features"] = proj.numpy()
    arrays[f"{name}.logits"] = logits.numpy()
    arrays[f"{name}.greedy"] = greedy.numpy().astype(np.int32)
    meta["cases"].append({"name": name, "images": [list(i[:2]) for i in images],
                          "tile_grids": grids, "prompt_length": len(ids),
                          "tiles": int(pv.shape[0]), "patch_tokens": int(proj.shape[0])})
    print(name, grids, len(ids), tuple(pv.shape), tuple(proj.shape), greedy.tolist())
  np.savez_compressed(OUT / "outputs.npz", **arrays)
  (OUT / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
  total = sum(f.stat().st_size for f in OUT.iterdir())
  print(f"wrote {OUT} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
  main()
