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

``--part sizes`` writes only ``size_sweep.json`` + ``size_sweep.npz`` (the other files stay as they are):
several hundred sizes and aspect ratios (1 x N, N x 1, tile multiples +/- 1, the 4:3 family where HF's
float32 resize arithmetic floors differently from float64, random ones) with the real 336-px / 16-tile
config and with 14- and 28-px tiles, plus gray, gray+alpha, RGBA and palette PNGs. Per size: HF's tile
grid, the size its no-distortion resize was called with, and the sha256 of its pixel values' bfloat16
bits; the full bits for the small cases. The RGB inputs are ``sweep_image`` (a 32-bit integer hash, no
random generator, so the test regenerates them exactly); the other modes are stored as PNG bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import pathlib
import sys

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.models.llama4.image_processing_llama4 import Llama4ImageProcessor
from transformers.models.llama4.processing_llama4 import Llama4Processor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from vision_sweep import sweep_image  # noqa: E402  (shared with the test)

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


class _Recording(Llama4ImageProcessor):
  """HF's processor, recording the size of its first resize call (the one without distortion)."""

  def resize(self, image, size, *args, **kwargs):
    self.resize_calls.append((int(size.height), int(size.width)))
    return super().resize(image, size, *args, **kwargs)


def hf_sweep_one(pil, tile, max_tiles, max_canvas):
  proc = _Recording(size={"height": tile, "width": tile}, max_patches=max_tiles,
                    resize_to_max_canvas=max_canvas)
  proc.resize_calls = []
  out = proc(images=[pil], return_tensors="pt")
  pv = out["pixel_values"]
  assert pv.dtype == torch.bfloat16, pv.dtype
  bits = pv.contiguous().view(torch.int16).numpy().view(np.uint16)
  grid = [int(v) for v in out["aspect_ratios"][0]]
  return bits, grid, list(proc.resize_calls[0])


def float64_size(h, w, tile, max_tiles, max_canvas, canvas):
  """The no-distortion resize size with every scale a Python float (HF's formula without its tensors):
  only to pick and count sweep sizes where HF's float32 arithmetic floors differently."""
  th, tw = canvas if max_canvas else (min(max(h, tile), canvas[0]), min(max(w, tile), canvas[1]))
  sw, sh = tw / w, th / h
  if sw < sh:
    return [max(min(math.floor(h * sw), th), 1), tw]
  return [th, max(min(math.floor(w * sh), tw), 1)]


def _hf_sizes(h, w, tile, max_tiles, max_canvas):
  """HF's canvas and no-distortion resize size from its own functions, called as its _preprocess
  calls them (to choose sweep sizes quickly; the sweep records the size of HF's real resize call)."""
  from transformers.image_utils import SizeDict
  from transformers.models.llama4.image_processing_llama4 import (
    find_supported_resolutions, get_best_fit, get_max_res_without_distortion)
  res = torch.tensor(find_supported_resolutions(max_num_chunks=max_tiles,
                                                patch_size=SizeDict(height=tile, width=tile)))
  t = get_best_fit(torch.Size((h, w)), res, resize_to_max_canvas=max_canvas)
  lim = t if max_canvas else (min(max(h, tile), t[0]), min(max(w, tile), t[1]))
  size = [max(int(v), 1) for v in get_max_res_without_distortion((h, w), lim)]
  return [int(v) for v in t], size


def _differs(h, w, tile, max_tiles, max_canvas):
  canvas, size = _hf_sizes(h, w, tile, max_tiles, max_canvas)
  return size != float64_size(h, w, tile, max_tiles, max_canvas, canvas)


def sweep_sizes(rng):
  """(h, w, tile, max_tiles, resize_to_max_canvas) for the RGB part of the size sweep."""
  out = []
  # the real Maverick config: 4:3 photos where float32 and float64 floor differently, and some that
  # agree; 1 x N / N x 1; sides at tile multiples +/- 1; random sizes; a few resize_to_max_canvas
  fam = [(h, h * 3 // 4) for h in range(300, 2100)] + [(h * 3 // 4, h) for h in range(300, 2100)]
  diff = [s for s in fam if _differs(*s, 336, 16, False)]
  same = [s for s in fam if s not in set(diff)]
  pick = lambda lst, n: [lst[i] for i in sorted(rng.choice(len(lst), min(n, len(lst)), replace=False))]
  out += [(h, w, 336, 16, False) for h, w in [(1600, 1200), (1200, 1600)] + pick(diff, 24) + pick(same, 6)]
  out += [(h, w, 336, 16, False) for h, w in [(1, 1), (1, 2), (2, 1), (1, 335), (1, 336), (1, 337),
                                              (335, 1), (337, 1), (1, 3000), (2200, 1), (5, 2000),
                                              (2000, 5)]]
  mult = [k * 336 + d for k in (1, 2, 3, 4) for d in (-1, 0, 1)]
  out += [(int(a), int(b), 336, 16, False) for a, b in rng.choice(mult, (16, 2))]
  for _ in range(20):
    h = int(rng.integers(1, 1700))
    w = max(1, min(2000, int(h * math.exp(rng.uniform(-2.5, 2.5)))))
    out.append((h, w, 336, 16, False))
  out += [(int(a), int(b), 336, 16, True) for a, b in rng.integers(20, 700, (6, 2))]
  # small tiles (cheap: many sizes): 14 px with 1..16 tiles, 28 px with 16
  for tile, n in ((14, 260), (28, 120)):
    cands = []
    for _ in range(n):
      max_tiles = int(rng.integers(1, 17)) if tile == 14 else 16
      max_canvas = bool(rng.random() < 0.2)
      kind = rng.random()
      if kind < 0.15:  # 1 x N or N x 1
        long = int(rng.integers(1, 30 * tile))
        h, w = (1, long) if rng.random() < 0.5 else (long, 1)
      elif kind < 0.4:  # tile multiples +/- 1
        h, w = (int(rng.integers(1, 7)) * tile + int(rng.integers(-1, 2)) for _ in range(2))
      elif kind < 0.7:  # 4:3 and 3:4
        a = int(rng.integers(1, 120))
        h, w = (4 * a, 3 * a) if rng.random() < 0.5 else (3 * a, 4 * a)
      else:
        h = int(rng.integers(1, 20 * tile))
        w = max(1, min(25 * tile, int(h * math.exp(rng.uniform(-2.5, 2.5)))))
      cands.append((h, w, tile, max_tiles, max_canvas))
    out += cands
  # float32-vs-float64 sizes with small tiles, searched for (they are rarer than at 336)
  found = 0
  while found < 40:
    tile = 14 if found % 2 else 28
    max_tiles = int(rng.integers(2, 17))
    h, w = (int(v) for v in rng.integers(1, 12 * tile, 2))
    max_canvas = bool(found % 5 == 4)
    if _differs(h, w, tile, max_tiles, max_canvas):
      out.append((h, w, tile, max_tiles, max_canvas))
      found += 1
  return out


# (mode, height, width, tile, max tiles, resize_to_max_canvas) of the PNG part of the size sweep
MODE_CASES = [
  ("L", 1, 90, 14, 16, False), ("L", 57, 43, 14, 6, False), ("L", 29, 29, 28, 16, True),
  ("LA", 40, 61, 14, 9, False), ("LA", 85, 15, 28, 16, False),
  ("RGBA", 1, 1, 14, 16, False), ("RGBA", 43, 29, 14, 16, False), ("RGBA", 100, 75, 28, 16, False),
  ("RGBA", 15, 113, 14, 4, True), ("RGBA", 300, 225, 336, 16, False),
  ("P", 70, 71, 14, 16, False), ("P", 13, 200, 28, 16, False), ("P", 90, 1, 14, 8, False),
  ("P+trns", 64, 48, 14, 16, False), ("P+trns", 111, 56, 28, 16, False),
  ("P+trns", 37, 350, 336, 16, False), ("L", 700, 1, 336, 16, False),
]


def mode_png(mode, h, w, seed) -> bytes:
  """A PNG of the given mode from sweep_image (palette images: a hashed palette, and for P+trns a
  tRNS chunk with alpha per palette entry)."""
  if mode in ("P", "P+trns"):
    idx = sweep_image(h, w, 1, seed)[..., 0]
    im = Image.frombytes("P", (w, h), idx.tobytes())
    im.putpalette(sweep_image(256, 1, 3, seed + 1).reshape(-1).tobytes())
    buf = io.BytesIO()
    kw = {"transparency": sweep_image(256, 1, 1, seed + 2).reshape(-1).tobytes()} if mode == "P+trns" else {}
    im.save(buf, format="PNG", **kw)
    return buf.getvalue()
  chans = {"L": 1, "LA": 2, "RGBA": 4}[mode]
  arr = sweep_image(h, w, chans, seed)
  im = Image.fromarray(arr[..., 0] if chans == 1 else arr, mode=mode)
  buf = io.BytesIO()
  im.save(buf, format="PNG")
  return buf.getvalue()


def write_size_sweep():
  rng = np.random.default_rng(20261207)
  meta = {"transformers": transformers.__version__, "torch": torch.__version__,
          "cpu_capability": torch.backends.cpu.get_cpu_capability(), "rgb": [], "modes": []}
  arrays = {}
  n_full = 0
  for i, (h, w, tile, max_tiles, max_canvas) in enumerate(sweep_sizes(rng)):
    seed = 1000 + i
    arr = sweep_image(h, w, 3, seed)
    bits, grid, size = hf_sweep_one(Image.fromarray(arr, mode="RGB"), tile, max_tiles, max_canvas)
    canvas, hf_size = _hf_sizes(h, w, tile, max_tiles, max_canvas)
    assert [canvas[0] // tile, canvas[1] // tile] == grid and hf_size == size, (h, w, tile)
    f64 = float64_size(h, w, tile, max_tiles, max_canvas, canvas)
    entry = {"height": h, "width": w, "seed": seed, "tile_size": tile, "max_tiles": max_tiles,
             "resize_to_max_canvas": max_canvas, "tile_grid": grid, "resized": size,
             "float64_size_differs": f64 != size,
             "input_sha256": hashlib.sha256(arr.tobytes()).hexdigest(),
             "pixel_values_shape": list(bits.shape),
             "sha256_bf16_bits": hashlib.sha256(bits.astype("<u2").tobytes()).hexdigest()}
    if tile <= 28 and bits.size <= 20000 and n_full < 12:  # a handful in full, for diagnosis
      arrays[f"rgb_{i}"] = bits
      entry["full"] = f"rgb_{i}"
      n_full += 1
    meta["rgb"].append(entry)
  for i, (mode, h, w, tile, max_tiles, max_canvas) in enumerate(MODE_CASES):
    png = mode_png(mode, h, w, seed=5000 + i)
    with Image.open(io.BytesIO(png)) as im:
      im.load()
      bits, grid, size = hf_sweep_one(im, tile, max_tiles, max_canvas)
    arrays[f"png_{i}"] = np.frombuffer(png, np.uint8)
    if bits.size <= 200000:
      arrays[f"mode_{i}"] = bits
    meta["modes"].append({"mode": mode, "height": h, "width": w, "png": f"png_{i}", "tile_size": tile,
                          "max_tiles": max_tiles, "resize_to_max_canvas": max_canvas,
                          "tile_grid": grid, "resized": size, "pixel_values_shape": list(bits.shape),
                          "full": f"mode_{i}" if bits.size <= 200000 else None,
                          "sha256_bf16_bits": hashlib.sha256(bits.astype("<u2").tobytes()).hexdigest()})
  np.savez_compressed(OUT / "size_sweep.npz", **arrays)
  (OUT / "size_sweep.json").write_text(json.dumps(meta, indent=0) + "\n")
  n = len(meta["rgb"]) + len(meta["modes"])
  n_diff = sum(e["float64_size_differs"] for e in meta["rgb"])
  size = sum((OUT / f).stat().st_size for f in ("size_sweep.json", "size_sweep.npz"))
  print(f"size sweep: {n} images, {n_diff} where float64 arithmetic floors differently; "
        f"{size / 1e6:.2f} MB")


def write_saved_processor_config():
  """tf5_processor_config.json: the processor_config.json that ``Llama4Processor.save_pretrained``
  writes (transformers 5 nests the image processor's settings in it; no preprocessor_config.json),
  for a processor with 56-px tiles and max_patches 5 (the tokenizer files it also writes are dropped)."""
  import tempfile
  specials = ["<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
              "<|tile_y_separator|>"]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]"] + specials)}, unk_token="[UNK]"))
  tok.add_special_tokens(specials)
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
  proc = Llama4Processor(image_processor=Llama4ImageProcessor(size={"height": 56, "width": 56},
                                                              max_patches=5), tokenizer=fast)
  with tempfile.TemporaryDirectory() as d:
    proc.save_pretrained(d)
    d = pathlib.Path(d)
    assert not (d / "preprocessor_config.json").exists()
    saved = (d / "processor_config.json").read_text()
  assert json.loads(saved)["image_processor"]["max_patches"] == 5
  (OUT / "tf5_processor_config.json").write_text(saved)
  print("wrote tf5_processor_config.json")


def main():
  OUT.mkdir(parents=True, exist_ok=True)
  for f in OUT.glob("*"):
    if not f.name.startswith(("size_sweep.", "tf5_")):  # written by --part sizes / saved
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
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--part", choices=["all", "cases", "sizes", "saved"], default="all",
                      help="cases: the original files (cases.json, PNG/.npz, sweep.npz); sizes: only "
                           "size_sweep.json/.npz; saved: only tf5_processor_config.json; all: all")
  args = parser.parse_args()
  if args.part in ("all", "cases"):
    main()
  if args.part in ("all", "sizes"):
    write_size_sweep()
  if args.part in ("all", "saved"):
    write_saved_processor_config()
