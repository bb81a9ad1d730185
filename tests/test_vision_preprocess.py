"""maverick.vision.preprocess against Hugging Face's Llama4ImageProcessor (Fast) and Llama4Processor.

The oracle is tests/fixtures/hf_llama4_vision/, written by tools/make_vision_fixture.py from HF
transformers 5.23 (torch 2.14.1, torchvision 0.29.1, CPU): pixel values (bfloat16 bits), tile grids and
the prompt token layout for synthetic images of several sizes, aspect ratios and modes. Smaller pieces are
checked against independent references: PIL's alpha compositing, ml_dtypes' bfloat16 rounding, a float64
resize, hand-worked grids and layouts.
"""

import hashlib
import io
import json
import pathlib
import re

import ml_dtypes
import numpy as np
import pytest

from maverick.vision import preprocess as P
from vision_sweep import sweep_image

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

FIX = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf_llama4_vision"
META = json.loads((FIX / "cases.json").read_text())
CASES = {c["name"]: c for c in META["cases"]}


def _cfg(case) -> P.VisionPreprocessConfig:
  return P.VisionPreprocessConfig(tile_size=case["tile_size"], max_tiles=case["max_tiles"],
                                  resize_to_max_canvas=case["resize_to_max_canvas"])


def _hf_pixels(name) -> np.ndarray:
  bits = np.load(FIX / f"{name}.npz", allow_pickle=False)["pixel_values_bf16_bits"]
  return (bits.astype(np.uint32) << 16).view(np.float32)


def _image(name) -> np.ndarray:
  with Image.open(FIX / f"{name}.png") as im:
    return np.asarray(im).copy()


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_hf(name):
  case = CASES[name]
  cfg = _cfg(case)
  out = P.preprocess_image(_image(name), cfg)
  ref = _hf_pixels(name)
  assert out.tile_grid == tuple(case["tile_grid"])
  assert out.pixel_values.shape == ref.shape == tuple(case["pixel_values_shape"])
  assert out.pixel_values.dtype == np.float32
  np.testing.assert_allclose(out.pixel_values, ref, rtol=0, atol=1e-6)
  assert np.array_equal(out.pixel_values, ref)  # in fact bit-exact
  assert cfg.patches_per_tile == case["patches_per_tile"]
  assert P.image_prompt_tokens(out.tile_grid, cfg) == case["prompt_tokens"]


def test_sweep_matches_hf():
  """40 small random-size images, 14-px tiles, 1..8 tiles, some resize_to_max_canvas: HF's grids and
  pixels, bit for bit (many downscale and upscale factors, every grid-choice branch)."""
  data = np.load(FIX / "sweep.npz", allow_pickle=False)
  images, bits = data["images"], data["pixel_values_bf16_bits"]
  i = j = 0
  grids = set()
  for case in META["sweep"]:
    h, w = case["height"], case["width"]
    img = images[i:i + h * w * 3].reshape(h, w, 3)
    n = int(np.prod(case["pixel_values_shape"]))
    ref = (bits[j:j + n].astype(np.uint32) << 16).view(np.float32).reshape(case["pixel_values_shape"])
    i, j = i + h * w * 3, j + n
    cfg = P.VisionPreprocessConfig(tile_size=14, max_tiles=case["max_tiles"],
                                   resize_to_max_canvas=case["resize_to_max_canvas"])
    out = P.preprocess_image(img, cfg)
    assert out.tile_grid == tuple(case["tile_grid"]), case
    np.testing.assert_array_equal(out.pixel_values, ref, err_msg=str(case))
    grids.add(out.tile_grid)
  assert i == images.size and j == bits.size and len(grids) >= 8


@pytest.mark.parametrize("name", ["gray_90x130", "rgba_120x70", "rgb_100x80"])
def test_decode_image_matches_hf(name):
  """File bytes -> decode_image (PIL's own RGBA-on-white conversion, as HF) -> the same pixels."""
  data = (FIX / f"{name}.png").read_bytes()
  cfg = _cfg(CASES[name])
  for src in (data, FIX / f"{name}.png", str(FIX / f"{name}.png")):
    rgb = P.decode_image(src)
    assert rgb.dtype == np.uint8 and rgb.shape[2] == 3
    np.testing.assert_array_equal(P.preprocess_image(rgb, cfg).pixel_values, _hf_pixels(name))


def test_preprocess_images_concatenates_like_hf():
  names = ["rgb_100x80", "rgb_336x336", "gray_90x130"]
  pv, grids = P.preprocess_images([_image(n) for n in names], _cfg(CASES[names[0]]))
  np.testing.assert_array_equal(pv, np.concatenate([_hf_pixels(n) for n in names]))
  assert grids == [tuple(CASES[n]["tile_grid"]) for n in names]
  with pytest.raises(P.ImageInputError, match="non-empty list"):
    P.preprocess_images([])


def test_whole_hf_processor_call():
  """HF's Llama4Processor.__call__ on a two-image prompt (a word-level tokenizer that knows the image
  specials): our expanded prompt splits into exactly its tokens, our batch equals its pixel values."""
  call = META["processor_call"]
  names = call["images"]
  cfg = _cfg(CASES[names[0]])
  pv, grids = P.preprocess_images([P.decode_image(FIX / f"{n}.png") for n in names], cfg)
  np.testing.assert_array_equal(pv, np.concatenate([_hf_pixels(n) for n in names]))
  text = P.expand_image_placeholders(call["text"], grids, cfg)
  specials = "|".join(re.escape(t) for t in (P.IMAGE_START, P.IMAGE_END, P.IMAGE_TOKEN, P.PATCH_TOKEN,
                                              P.TILE_X_SEPARATOR, P.TILE_Y_SEPARATOR))
  tokens = [t for piece in re.split(f"({specials})", text)
            for t in ([piece] if re.fullmatch(specials, piece) else piece.split())]
  assert tokens == call["tokens"]
  assert tokens.count(P.IMAGE_TOKEN) == 2 and tokens.count(P.IMAGE_START) == 2


def test_composite_on_white_matches_pil_for_every_color_alpha():
  c, a = np.meshgrid(np.arange(256, dtype=np.uint8), np.arange(256, dtype=np.uint8), indexing="ij")
  rgba = np.stack([c, 255 - c, c // 2 + 7, a], -1)
  white = Image.new("RGBA", (256, 256), (255, 255, 255))
  ref = np.asarray(Image.alpha_composite(white, Image.fromarray(rgba, "RGBA")).convert("RGB"))
  np.testing.assert_array_equal(P.to_rgb_uint8(rgba), ref)


def test_gray_is_replicated():
  g = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
  for arr in (g, g[:, :, None]):
    out = P.to_rgb_uint8(arr)
    assert out.shape == (3, 4, 3) and all(np.array_equal(out[..., k], g) for k in range(3))


def test_bf16_rounding_matches_ml_dtypes():
  rng = np.random.default_rng(0)
  x = np.concatenate([rng.normal(0, 3, 10000), np.arange(256) / 255.0, [0.5, -1.0, 1e-30]]).astype(np.float32)
  ref = x.astype(ml_dtypes.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(P._bf16(x), ref)


def test_rescale_normalize_vs_float64():
  """bfloat16 arithmetic stays within bfloat16 rounding (2^-8 relative) of the exact (x/255-m)/s."""
  img = np.arange(256, dtype=np.uint8).reshape(16, 16, 1).repeat(3, 2)
  cfg = P.VisionPreprocessConfig(image_mean=(0.48, 0.46, 0.41), image_std=(0.27, 0.26, 0.28))
  out = P._rescale_normalize(img, cfg).astype(np.float64)
  exact = (img.astype(np.float64).transpose(2, 0, 1) / 255.0
           - np.array(cfg.image_mean)[:, None, None]) / np.array(cfg.image_std)[:, None, None]
  assert np.abs(out - exact).max() < 0.03  # a few bf16 roundings of values up to ~2
  assert np.abs(out - exact).max() > 0  # and really rounded (not float32 throughout)


def _resize_f64(img, oh, ow):
  """Antialiased bilinear (triangle filter widened by the downscale factor), float64, no rounding."""
  def mat(n_in, n_out):
    s = n_in / n_out
    sup = max(s, 1.0)
    m = np.zeros((n_out, n_in))
    for i in range(n_out):
      c = s * (i + 0.5)
      for j in range(max(int(c - sup + 0.5), 0), min(int(c + sup + 0.5), n_in)):
        m[i, j] = max(0.0, 1 - abs((j - c + 0.5) / sup))
      m[i] /= m[i].sum()
    return m
  rows = np.einsum("oh,hwc->owc", mat(img.shape[0], oh), img.astype(np.float64))
  return np.einsum("owc,pw->opc", rows, mat(img.shape[1], ow))


@pytest.mark.parametrize("shape", [(37, 250, 19, 56), (30, 20, 56, 56), (100, 80, 224, 179), (9, 9, 9, 4),
                                   (3000, 2, 1, 2)])  # the last: 22-bit weights, int32 headroom
def test_resize_close_to_float64(shape):
  h, w, oh, ow = shape
  img = np.random.default_rng(1).integers(0, 256, (h, w, 3)).astype(np.uint8)
  out = P.resize_bilinear_uint8(img, oh, ow)
  assert out.shape == (oh, ow, 3) and out.dtype == np.uint8
  assert np.abs(out.astype(np.float64) - _resize_f64(img, oh, ow)).max() <= 1.0  # two uint8 roundings


@pytest.mark.parametrize("value", [0, 1, 128, 255])
def test_resize_keeps_constant_images(value):
  """Weights sum to one per output: a flat image stays flat, 255 included (no int32 overflow even
  with 22-bit weights when shrinking 3000 rows to 1)."""
  for h, w, oh, ow in [(3000, 2, 1, 2), (7, 9, 40, 3), (336, 500, 112, 167)]:
    img = np.full((h, w, 3), value, np.uint8)
    assert (P.resize_bilinear_uint8(img, oh, ow) == value).all()


def test_supported_resolutions_and_best_fit_hand_worked():
  res = P.supported_resolutions(5, 224)
  assert sorted(res) == sorted({(r * 224, c * 224) for r in range(1, 6) for c in range(1, 6) if r * c <= 5})
  assert len(res) == len(set(res))
  # HF's docstring example: 200x300 fits 224x448 and 672x224 at scale 1.12; the smaller area wins
  assert P.best_fit((200, 300), [(224, 672), (672, 224), (224, 448), (448, 224), (224, 224)]) == (224, 448)
  # upscaling possible (5x3 tiles at 1.12) beats downscaling into 4x2 (0.896)
  assert P.best_fit((1000, 500), P.supported_resolutions(16, 224)) == (1120, 672)
  # no upscaling possible: the least downscaling, 0.448, reached by 2x1, 3x1, 4x1 and 2x2: least area
  assert P.best_fit((1000, 500), P.supported_resolutions(4, 224)) == (448, 224)
  # resize_to_max_canvas: the largest upscale (a 100x100 image can fill 4x4 tiles of 224)
  assert P.best_fit((100, 100), P.supported_resolutions(16, 224), resize_to_max_canvas=True) == (896, 896)
  assert P.best_fit((100, 100), P.supported_resolutions(16, 224)) == (224, 224)


def test_prompt_tokens_hand_worked():
  cfg = P.VisionPreprocessConfig()
  assert cfg.patches_per_tile == 144  # (336 / 14)^2 / 4
  one = P.image_prompt_tokens((1, 1), cfg)
  assert one == "<|image_start|><|image|>" + "<|patch|>" * 144 + "<|image_end|>"
  two_by_three = P.image_prompt_tokens((2, 3), cfg)
  assert two_by_three.count("<|patch|>") == 7 * 144
  assert two_by_three.count("<|tile_x_separator|>") == 2 * 2
  assert two_by_three.count("<|tile_y_separator|>") == 2
  row = "<|tile_x_separator|>".join(["<|patch|>" * 144] * 3) + "<|tile_y_separator|>"
  assert two_by_three == "<|image_start|>" + row * 2 + "<|image|>" + "<|patch|>" * 144 + "<|image_end|>"


def test_expand_image_placeholders():
  a, b = CASES["rgb_100x80"], CASES["rgb_500x1000"]
  cfg = _cfg(a)
  text = "<|header_start|>user<|header_end|>\n\n<|image|>compare with<|image|>please"
  out = P.expand_image_placeholders(text, [tuple(a["tile_grid"]), tuple(b["tile_grid"])], cfg)
  assert out == ("<|header_start|>user<|header_end|>\n\n" + a["prompt_tokens"] + "compare with"
                 + b["prompt_tokens"] + "please")
  with pytest.raises(P.ImageInputError, match="2 <\\|image\\|> placeholders but 1 images"):
    P.expand_image_placeholders(text, [(1, 1)], cfg)


@pytest.mark.parametrize("bad, match", [
    (np.zeros((4, 4, 3), np.float32) + 0.5, "must be uint8"),
    (np.ones((4, 4, 2), np.uint8), "HxW, HxWx1, HxWx3 or HxWx4"),
    (np.ones((1, 4, 4, 3), np.uint8), "HxW, HxWx1, HxWx3 or HxWx4"),
    (np.ones((3, 40, 50), np.uint8), "HxW, HxWx1, HxWx3 or HxWx4"),  # channels first
    (np.ones((0, 4, 3), np.uint8), "empty side"),
])
def test_bad_arrays(bad, match):
  with pytest.raises(P.ImageInputError, match=match):
    P.preprocess_image(bad)


def test_bad_files():
  png = (FIX / "rgb_20x20_tiny.png").read_bytes()
  for data in (b"", b"not an image at all", png[: len(png) // 2], b"%PDF-1.4\n" + bytes(range(256))):
    with pytest.raises(P.ImageInputError, match="cannot decode image"):
      P.decode_image(data)
  with pytest.raises(P.ImageInputError, match="file bytes or a path"):
    P.decode_image(np.zeros((2, 2, 3), np.uint8))


def test_other_modes_decode_like_hf_conversion():
  """Palette and 16-bit gray files go through PIL's RGBA conversion + white composite (as HF)."""
  rng = np.random.default_rng(2)
  pal = Image.fromarray(rng.integers(0, 256, (9, 7), dtype=np.uint8), "L").convert("P")
  buf = io.BytesIO()
  pal.save(buf, format="PNG")
  ref = np.asarray(pal.convert("RGBA").convert("RGB"))  # opaque: compositing changes nothing
  np.testing.assert_array_equal(P.decode_image(buf.getvalue()), ref)


def test_config_errors():
  with pytest.raises(ValueError, match="multiple of patch_size"):
    P.VisionPreprocessConfig(tile_size=50)
  with pytest.raises(ValueError, match=">= 1"):
    P.VisionPreprocessConfig(max_tiles=0)
  with pytest.raises(ValueError, match="pixel_shuffle_ratio"):
    P.VisionPreprocessConfig(pixel_shuffle_ratio=0)


def _matches_fixture(names=("rgb_100x80", "rgb_1200x300", "rgb_60x130_maxcanvas")) -> bool:
  for name in names:
    out = P.preprocess_image(_image(name), _cfg(CASES[name]))
    ref = _hf_pixels(name)
    if out.tile_grid != tuple(CASES[name]["tile_grid"]) or out.pixel_values.shape != ref.shape:
      return False
    if not np.array_equal(out.pixel_values, ref):
      return False
  return True


@pytest.mark.parametrize("mutant", ["resize_vertical_first", "best_fit_largest_area", "no_bf16",
                                    "stretch_to_canvas"])
def test_plausible_bugs_break_the_fixture_match(monkeypatch, mutant):
  """The fixture comparison can fail: each plausible bug, patched in, makes it fail."""
  assert _matches_fixture()
  best_fit = P.best_fit
  if mutant == "resize_vertical_first":
    monkeypatch.setattr(P, "resize_bilinear_uint8",
                        lambda img, h, w: P._resize_axis(P._resize_axis(img, h, axis=0), w, axis=1))
  elif mutant == "best_fit_largest_area":
    def largest(image_hw, res, resize_to_max_canvas=False):
      chosen = best_fit(image_hw, res, resize_to_max_canvas)
      scale = lambda r: min(r[0] / image_hw[0], r[1] / image_hw[1])
      ties = [r for r in res if scale(r) == scale(chosen)]
      return max(ties, key=lambda r: r[0] * r[1])
    monkeypatch.setattr(P, "best_fit", largest)
  elif mutant == "no_bf16":
    monkeypatch.setattr(P, "_bf16", lambda x: np.asarray(x, np.float32))
  elif mutant == "stretch_to_canvas":  # aspect ratio not kept
    monkeypatch.setattr(P, "_resize_target", lambda hw, canvas, tile, max_canvas: canvas)
  assert not _matches_fixture()


# --------------------------------------------------------------------------- size sweep (HF, bit for bit)

SIZE_SWEEP = json.loads((FIX / "size_sweep.json").read_text())


def _bf16_bits(pixel_values: np.ndarray) -> np.ndarray:
  bits = np.ascontiguousarray(pixel_values, np.float32).view(np.uint32)
  assert not (bits & 0xFFFF).any()  # bfloat16 values
  return (bits >> 16).astype("<u2")


def _sweep_mismatch(entry, img, full) -> str | None:
  """Why our preprocessing of ``img`` differs from HF's record ``entry``, or None when it is equal."""
  cfg = P.VisionPreprocessConfig(tile_size=entry["tile_size"], max_tiles=entry["max_tiles"],
                                 resize_to_max_canvas=entry["resize_to_max_canvas"])
  hw = img.shape[:2]
  canvas = P.best_fit(hw, P.supported_resolutions(cfg.max_tiles, cfg.tile_size), cfg.resize_to_max_canvas)
  resized = P._resize_target(hw, canvas, cfg.tile_size, cfg.resize_to_max_canvas)
  out = P.preprocess_image(img, cfg)
  bits = _bf16_bits(out.pixel_values)
  if out.tile_grid != tuple(entry["tile_grid"]):
    return f"tile grid {out.tile_grid} != HF {entry['tile_grid']}"
  if list(resized) != entry["resized"]:
    return f"resized to {resized} != HF {entry['resized']}"
  if list(bits.shape) != entry["pixel_values_shape"]:
    return f"shape {bits.shape} != HF {entry['pixel_values_shape']}"
  if full is not None and not np.array_equal(bits, full):
    return f"{int((bits != full).sum())} pixel values differ"
  if hashlib.sha256(bits.tobytes()).hexdigest() != entry["sha256_bf16_bits"]:
    return "pixel values differ (sha256 of the bfloat16 bits)"
  return None


def _check_sweep(entries, make_image, full_arrays):
  bad = []
  for entry in entries:
    img = make_image(entry)
    key = entry.get("full")
    msg = _sweep_mismatch(entry, img, full_arrays[key] if key else None)
    if msg:
      bad.append(f"{entry.get('mode', 'RGB')} {entry['height']}x{entry['width']} tile "
                 f"{entry['tile_size']} max {entry['max_tiles']} max_canvas "
                 f"{entry['resize_to_max_canvas']}: {msg}")
  assert not bad, f"{len(bad)} of {len(entries)} sizes differ from HF:\n" + "\n".join(bad[:20])


def _rgb_input(entry):
  img = sweep_image(entry["height"], entry["width"], 3, entry["seed"])
  assert hashlib.sha256(img.tobytes()).hexdigest() == entry["input_sha256"], "sweep_image drifted"
  return img


@pytest.mark.parametrize("part", ["small_tiles", "real_config"])
def test_size_sweep_matches_hf(part):
  """Hundreds of sizes (1 x N, N x 1, tile multiples +/- 1, 4:3 photos, random), with 14/28-px tiles and
  with the real 336-px / 16-tile config: HF's tile grid, resize size and pixel values, bit for bit.
  Dozens of them are sizes where HF's float32 scale floors one pixel lower than float64 arithmetic."""
  real = part == "real_config"
  entries = [e for e in SIZE_SWEEP["rgb"] if (e["tile_size"] == 336) == real]
  assert len(entries) >= (80 if real else 400)
  assert sum(e["float64_size_differs"] for e in entries) >= (20 if real else 40)
  assert any(e["height"] == 1 for e in entries) and any(e["width"] == 1 for e in entries)
  with np.load(FIX / "size_sweep.npz", allow_pickle=False) as data:
    full = {k: data[k] for k in data.files}
  _check_sweep(entries, _rgb_input, full)


def test_size_sweep_modes_match_hf():
  """Gray, gray + alpha, RGBA, palette and palette + tRNS PNGs through decode_image: HF's pixels."""
  with np.load(FIX / "size_sweep.npz", allow_pickle=False) as data:
    full = {k: data[k] for k in data.files}
  entries = SIZE_SWEEP["modes"]
  assert {e["mode"] for e in entries} == {"L", "LA", "RGBA", "P", "P+trns"}
  _check_sweep(entries, lambda e: P.decode_image(full[e["png"]].tobytes()), full)


def test_resize_target_float32_example():
  """The issue's example: HF floors 1200 * float32(1344 / 1600) = 1007.99994 to 1007 (float64: 1008).
  Transposed, the two float32 scales tie, so the other branch keeps the height: 1008 x 1344 (HF too,
  see the size sweep)."""
  canvas = P.best_fit((1600, 1200), P.supported_resolutions(16, 336))
  assert canvas == (1344, 1008)
  assert P._resize_target((1600, 1200), canvas, 336, False) == (1344, 1007)
  assert P._resize_target((1200, 1600), canvas[::-1], 336, False) == (1008, 1344)
