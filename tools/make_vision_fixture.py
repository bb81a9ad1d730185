"""Write tests/fixtures/hf_llama4_vision/ from Hugging Face's Llama 4 image processor + processor.

A side tool, never imported by the tests. It needs an environment with transformers, torch, torchvision
and Pillow (the project venv has none of the first three), e.g.

  python3.11 -m venv /work/venvhf
  /work/venvhf/bin/pip install torch==2.14.1 torchvision==0.29.1 transformers==5.23.0 pillow numpy
  /work/venvhf/bin/python tools/make_vision_fixture.py

Images are synthetic and deterministic: smooth gradients plus seeded noise on 4x4 blocks (sharp edges
that show the resize filter, yet compressible). Inputs are stored as PNG (lossless; the tests read them
with Pillow, to arrays and through ``decode_image``).
Small tiles (56 px instead of 336) keep the fixture small; one case uses the real 336/16 config. Pixel
values are bfloat16 in HF; they are stored as their uint16 bit patterns (lossless) in compressed .npz.
The token layout is taken from HF's ``Llama4Processor.replace_image_token`` (the layout is built before
tokenization, so no tokenizer is needed). A sweep of 40 small random-size noise images (14-px tiles, 1 to
8 tiles) adds many resize scales and grid choices.
"""

from __future__ import annotations

import io
import json
import pathlib

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.llama4.image_processing_llama4 import Llama4ImageProcessor
from transformers.models.llama4.processing_llama4 import Llama4Processor

OUT = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf_llama4_vision"

# (name, height, width, PIL mode, tile size, max tiles, resize_to_max_canvas)
CASES = [
  ("rgb_100x80", 100, 80, "RGB", 56, 16, False),
  ("rgb_336x336", 336, 336, "RGB", 56, 16, False),
  ("rgb_500x1000", 500, 1000, "RGB", 56, 16, False),
  ("rgb_1200x300", 1200, 300, "RGB", 56, 16, False),
  ("rgb_37x250_max5", 37, 250, "RGB", 56, 5, False),
  ("gray_90x130", 90, 130, "L", 56, 16, False),
  ("rgba_120x70", 120, 70, "RGBA", 56, 16, False),
  ("rgb_200x150_real", 200, 150, "RGB", 336, 16, False),
  ("rgb_20x20_tiny", 20, 20, "RGB", 56, 16, False),
  ("rgb_60x130_maxcanvas", 60, 130, "RGB", 56, 9, True),
]


def synthetic(h: int, w: int, mode: str, seed: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  yy, xx = np.meshgrid(np.linspace(0, 1, h), np.linspace(0, 1, w), indexing="ij")
  chans = 4 if mode == "RGBA" else (1 if mode == "L" else 3)
  base = np.stack([np.sin(3 * xx + c) * np.cos(5 * yy - c) for c in range(chans)], -1)
  blocks = rng.integers(-40, 41, ((h + 3) // 4, (w + 3) // 4, chans))
  noise = np.repeat(np.repeat(blocks, 4, axis=0), 4, axis=1)[:h, :w]
  img = 127.5 + 90 * base + noise
  img = np.clip(np.round(img), 0, 255).astype(np.uint8)
  if mode == "RGBA":  # alpha spanning fully transparent to opaque
    img[..., 3] = np.clip(np.round(255 * xx) + noise[..., 0], 0, 255).astype(np.uint8)
    img[: h // 4, : w // 4, 3] = 0
  return img[..., 0] if mode == "L" else img


def hf_process(pil, tile, max_tiles, max_canvas):
  """HF's pixel values (bfloat16 bits), tile grid and prompt layout for one image."""
  proc = Llama4ImageProcessor(size={"height": tile, "width": tile}, max_patches=max_tiles,
                              resize_to_max_canvas=max_canvas)
  out = proc(images=[pil], return_tensors="pt")
  pv = out["pixel_values"]
  assert pv.dtype == torch.bfloat16, pv.dtype
  grid = [int(v) for v in out["aspect_ratios"][0]]
  # the layout string, from HF's processor method that writes it (it needs no vocabulary, so the
  # processor is built without its tokenizer: patch size 14, pixel shuffle 0.5 as __init__ sets them)
  p = Llama4Processor.__new__(Llama4Processor)
  p.patch_size, p.downsample_ratio = 14, int(round(1.0 / (0.5 ** 2)))
  layout = p.replace_image_token({"pixel_values": pv, "aspect_ratios": out["aspect_ratios"]}, 0)
  bits = pv.contiguous().view(torch.int16).numpy().view(np.uint16)
  return bits, grid, layout


def processor_call(images):
  """HF's whole ``Llama4Processor.__call__`` on a two-image prompt, with a word-level tokenizer that
  knows the image special tokens: the prompt's tokens (as strings) and the pixel values."""
  specials = ["<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
              "<|tile_y_separator|>"]
  vocab = {w: i for i, w in enumerate(["[UNK]", "describe", "and", "compare", "."] + specials)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(specials)
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
  proc = Llama4Processor(image_processor=Llama4ImageProcessor(size={"height": 56, "width": 56},
                                                              max_patches=16), tokenizer=fast)
  text = "describe <|image|> and compare <|image|> ."
  out = proc(images=images, text=[text], return_tensors="pt")
  tokens = fast.convert_ids_to_tokens(out["input_ids"][0].tolist())
  return {"text": text, "tokens": tokens}, out["pixel_values"]


def main():
  OUT.mkdir(parents=True, exist_ok=True)
  for f in OUT.glob("*"):
    f.unlink()
  meta = {"transformers": transformers.__version__, "torch": torch.__version__,
          "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cases": [], "sweep": []}
  for i, (name, h, w, mode, tile, max_tiles, max_canvas) in enumerate(CASES):
    arr = synthetic(h, w, mode, seed=i)
    pil = Image.fromarray(arr, mode=mode)
    bits, grid, layout = hf_process(pil, tile, max_tiles, max_canvas)
    n_patch = layout.count("<|patch|>") // (grid[0] * grid[1] + (grid[0] * grid[1] > 1))
    buf = io.BytesIO()
    pil.save(buf, format="PNG", optimize=True)
    (OUT / f"{name}.png").write_bytes(buf.getvalue())
    np.savez_compressed(OUT / f"{name}.npz", pixel_values_bf16_bits=bits)
    meta["cases"].append({"name": name, "height": h, "width": w, "mode": mode, "tile_size": tile,
                          "max_tiles": max_tiles, "resize_to_max_canvas": max_canvas,
                          "tile_grid": grid, "patches_per_tile": n_patch,
                          "pixel_values_shape": list(bits.shape), "prompt_tokens": layout})
    print(name, grid, bits.shape)
  # the whole processor on a prompt with two of the images above
  pair = ["rgb_100x80", "gray_90x130"]
  call, pv = processor_call([Image.open(OUT / f"{n}.png") for n in pair])
  ref = np.concatenate([np.load(OUT / f"{n}.npz")["pixel_values_bf16_bits"] for n in pair])
  assert np.array_equal(pv.contiguous().view(torch.int16).numpy().view(np.uint16), ref)
  meta["processor_call"] = {"images": pair, **call}
  # a sweep of small random sizes (14-px tiles, 1..8 tiles): many resize scales and grid choices
  rng = np.random.default_rng(1234)
  images, pixels = [], []
  for k in range(40):
    h, w = (int(v) for v in rng.integers(3, 90, 2))
    max_tiles, max_canvas = int(rng.integers(1, 9)), bool(k % 4 == 3)
    blocks = rng.integers(0, 256, ((h + 1) // 2, (w + 1) // 2, 3), dtype=np.uint8)  # 2x2 blocks
    arr = np.ascontiguousarray(blocks.repeat(2, 0).repeat(2, 1)[:h, :w])
    bits, grid, _ = hf_process(Image.fromarray(arr, mode="RGB"), 14, max_tiles, max_canvas)
    images.append(arr.ravel())
    pixels.append(bits.ravel())
    meta["sweep"].append({"height": h, "width": w, "max_tiles": max_tiles,
                          "resize_to_max_canvas": max_canvas, "tile_grid": grid,
                          "pixel_values_shape": list(bits.shape)})
  np.savez_compressed(OUT / "sweep.npz", images=np.concatenate(images),
                      pixel_values_bf16_bits=np.concatenate(pixels))
  (OUT / "cases.json").write_text(json.dumps(meta, indent=1) + "\n")
  total = sum(f.stat().st_size for f in OUT.iterdir())
  print(f"wrote {OUT} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
  main()
