"""Llama 4 image preprocessing on NumPy, bit-exact to Hugging Face's ``Llama4ImageProcessor`` (Fast).

The pipeline (HF transformers 5.23, checked by tests/test_vision_preprocess.py against a fixture that
tools/make_vision_fixture.py writes from HF itself):

1. Convert to RGB (grayscale replicated, RGBA alpha-composited on white as PIL does in HF).
2. Pick the canvas: the tile grids ``(rows, cols)`` with ``rows * cols <= max_tiles`` give canvases
   ``(rows * tile, cols * tile)``; the best one needs the least downscaling (or the least upscaling when
   upscaling is possible), ties broken by the smallest area (HF ``get_best_fit``).
3. Resize without distortion into the canvas (a side shorter than a tile grows to at most one tile, a
   longer one never grows; ``resize_to_max_canvas`` lifts that cap; the size in HF's mix of float32
   and float64 arithmetic, see ``_resize_target``), bilinear with antialias in
   torch's uint8 fixed-point arithmetic (int16 weights, per-pass precision), pad right/bottom with 0.
4. Rescale and normalize in bfloat16, as the original implementation (and HF) do.
5. Split into row-major tiles; when there is more than one tile, append a global thumbnail (the whole
   image resized, with distortion, to one tile).

``pixel_values`` are float32 holding bfloat16 values, shape ``(tiles, 3, tile, tile)``. The oracle is HF on
a CPU with AVX2/AVX512 or on aarch64, where torchvision resizes uint8 natively (elsewhere it resizes in
float32 and HF's output differs from this by rounding). Pure NumPy; Pillow
(``pip install maverick-jax[vision]``) is needed only to decode image files (``decode_image``).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
from collections import defaultdict

import numpy as np

IMAGE_TOKEN = "<|image|>"
IMAGE_START = "<|image_start|>"
IMAGE_END = "<|image_end|>"
PATCH_TOKEN = "<|patch|>"
TILE_X_SEPARATOR = "<|tile_x_separator|>"
TILE_Y_SEPARATOR = "<|tile_y_separator|>"


class ImageInputError(ValueError):
  """An image that cannot be preprocessed: wrong shape/dtype, corrupt bytes, unsupported mode."""


@dataclasses.dataclass(frozen=True)
class VisionPreprocessConfig:
  """Llama 4 Maverick/Scout defaults (HF preprocessor_config.json + processor_config.json)."""

  tile_size: int = 336
  max_tiles: int = 16
  patch_size: int = 14
  pixel_shuffle_ratio: float = 0.5
  resize_to_max_canvas: bool = False
  rescale_factor: float = 1.0 / 255.0
  image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
  image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

  def __post_init__(self):
    if self.tile_size < 1 or self.max_tiles < 1 or self.patch_size < 1:
      raise ValueError(
        f"tile_size, max_tiles and patch_size must be >= 1 (got {self.tile_size}, "
        f"{self.max_tiles}, {self.patch_size})")
    if self.tile_size % self.patch_size:
      raise ValueError(f"tile_size {self.tile_size} must be a multiple of patch_size {self.patch_size}")
    if not 0 < self.pixel_shuffle_ratio <= 1:
      raise ValueError(f"pixel_shuffle_ratio must be in (0, 1], got {self.pixel_shuffle_ratio}")

  @property
  def patches_per_tile(self) -> int:
    """``<|patch|>`` tokens per tile: patches after the pixel shuffle (144 for 336/14/0.5)."""
    downsample = int(round(1.0 / self.pixel_shuffle_ratio ** 2))
    return (self.tile_size // self.patch_size) ** 2 // downsample


@dataclasses.dataclass(frozen=True)
class PreprocessedImage:
  pixel_values: np.ndarray  # (tiles [+1 global], 3, tile, tile) float32 holding bfloat16 values
  tile_grid: tuple[int, int]  # (rows, cols) of the local tiles; HF's aspect_ratios row


# ---------------------------------------------------------------------------------------------- grid


def supported_resolutions(max_tiles: int, tile_size: int) -> list[tuple[int, int]]:
  """Canvases ``(h, w)`` for every grid with at most ``max_tiles`` tiles, in HF's order (the order
  matters only for ties, which ``best_fit`` breaks by area, first minimum wins)."""
  by_ratio: dict[float, list[tuple[int, int]]] = defaultdict(list)
  for n in range(max_tiles, 0, -1):
    for rows in sorted(d for d in range(1, n + 1) if n % d == 0):
      by_ratio[rows / (n // rows)].append((rows, n // rows))
  return [(r * tile_size, c * tile_size) for grids in by_ratio.values() for r, c in grids]


def best_fit(image_hw: tuple[int, int], resolutions, resize_to_max_canvas: bool = False) -> tuple[int, int]:
  """The canvas the image is resized into (HF ``get_best_fit``; scales in float32 as torch has them)."""
  res = np.asarray(resolutions, np.int64)
  h, w = (np.float32(v) for v in image_hw)
  scale_h = res[:, 0].astype(np.float32) / h
  scale_w = res[:, 1].astype(np.float32) / w
  scales = np.where(scale_h > scale_w, scale_w, scale_h)
  up = scales[scales >= 1]
  if up.size:
    chosen = up.max() if resize_to_max_canvas else up.min()
  else:
    chosen = scales[scales < 1].max()
  cands = res[scales == chosen]
  best = cands[np.argmin(cands[:, 0] * cands[:, 1])]
  return int(best[0]), int(best[1])


def _resize_target(image_hw, canvas, tile_size: int, resize_to_max_canvas: bool) -> tuple[int, int]:
  """The size the image is resized to before padding to ``canvas`` (HF's resize without distortion).

  HF mixes number types here and the result depends on it: ``get_best_fit`` returns the canvas as a
  torch int64 tensor, while the image size and the one-tile upscale cap are Python ints. A side limit
  is a tensor when the canvas side wins ``min(max(side, tile), canvas_side)`` (Python's ``min`` keeps
  the first of equal values) or always with ``resize_to_max_canvas``; its scale is then a float32
  tensor, otherwise a Python float (float64). A comparison or product that involves a float32 tensor
  runs in float32 (Python floats rounded to float32): 1200 * (1344 / 1600) floors to 1007, not 1008.
  """
  limit, is_f32 = [], []
  for side, canvas_side in zip(image_hw, canvas):
    if resize_to_max_canvas:
      limit.append(canvas_side)
      is_f32.append(True)
    else:  # upscale at most to one tile
      cap = max(side, tile_size)
      is_f32.append(canvas_side < cap)
      limit.append(canvas_side if canvas_side < cap else cap)
  (h, w), (th, tw), (th_f32, tw_f32) = image_hw, limit, is_f32
  scale_h = np.float32(th) / np.float32(h) if th_f32 else th / h
  scale_w = np.float32(tw) / np.float32(w) if tw_f32 else tw / w
  if th_f32 or tw_f32:
    width_limits = np.float32(scale_w) < np.float32(scale_h)
  else:
    width_limits = scale_w < scale_h
  if width_limits:
    new = np.float32(h) * scale_w if tw_f32 else h * scale_w
    nh, nw = min(math.floor(new), th), tw
  else:
    new = np.float32(w) * scale_h if th_f32 else w * scale_h
    nh, nw = th, min(math.floor(new), tw)
  return max(int(nh), 1), max(int(nw), 1)


# -------------------------------------------------------------------------------------------- resize


def _aa_bilinear_int16_weights(in_size: int, out_size: int):
  """torch's antialiased bilinear weights for uint8 (``_compute_index_ranges_int16_weights``): float64
  triangle weights normalized per output, then int16 with one precision for the whole pass."""
  scale = in_size / out_size
  support = scale if scale >= 1.0 else 1.0
  invscale = 1.0 / scale if scale >= 1.0 else 1.0
  taps = int(math.ceil(support)) * 2 + 1
  xmin = np.zeros(out_size, np.int64)
  w = np.zeros((out_size, taps), np.float64)
  for i in range(out_size):
    center = scale * (i + 0.5)
    lo = max(int(center - support + 0.5), 0)
    size = min(max(min(int(center + support + 0.5), in_size) - lo, 0), taps)
    total = 0.0
    for j in range(size):
      x = abs((j + lo - center + 0.5) * invscale)
      w[i, j] = 1.0 - x if x < 1.0 else 0.0
      total += w[i, j]
    if total != 0.0:
      w[i, :size] /= total
    xmin[i] = lo
  wmax = w.max()
  prec = 0
  while prec < 22 and int(0.5 + wmax * (1 << (prec + 1))) < (1 << 15):
    prec += 1
  v = w * (1 << prec)
  w16 = np.where(v < 0, np.trunc(v - 0.5), np.trunc(v + 0.5)).astype(np.int32)
  idx = np.minimum(xmin[:, None] + np.arange(taps)[None, :], in_size - 1)  # zero weights past the end
  return idx, w16, prec


def _resize_axis(img: np.ndarray, out_size: int, axis: int) -> np.ndarray:
  in_size = img.shape[axis]
  if in_size == out_size:
    return img
  idx, w16, prec = _aa_bilinear_int16_weights(in_size, out_size)
  shape = list(img.shape)
  shape[axis] = out_size
  bcast = [1] * img.ndim
  bcast[axis] = out_size
  # int32 as torch: the weights sum to about 2^prec <= 2^22, so 255 * that fits
  acc = np.full(shape, 1 << (prec - 1), np.int32)
  tap = np.empty(shape, np.int32)
  for j in range(idx.shape[1]):
    if w16[:, j].any():  # gather along the axis in place (no transposed copies), exact int32
      np.multiply(np.take(img, idx[:, j], axis=axis), w16[:, j].reshape(bcast), out=tap)
      acc += tap
  acc >>= prec
  return np.clip(acc, 0, 255).astype(np.uint8)


def resize_bilinear_uint8(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
  """HxWxC uint8 -> out_h x out_w x C uint8, antialiased bilinear exactly as torch's CPU uint8 kernel
  (torchvision ``resize(..., antialias=True)``): horizontal pass, round to uint8, vertical pass."""
  return _resize_axis(_resize_axis(img, out_w, axis=1), out_h, axis=0)


# ----------------------------------------------------------------------------------- rescale/normalize


def _bf16(x: np.ndarray) -> np.ndarray:
  """Round float32 to the nearest bfloat16 (ties to even), returned as float32."""
  u = np.ascontiguousarray(x, np.float32).view(np.uint32)
  u = (u + (((u >> 16) & 1) + np.uint32(0x7FFF))) & np.uint32(0xFFFF0000)
  return u.view(np.float32)


def _rescale_normalize(img: np.ndarray, cfg: VisionPreprocessConfig) -> np.ndarray:
  """HxWx3 uint8 -> 3xHxW; each op in float32 rounded to bfloat16, as torch's bfloat16 CPU kernels."""
  x = np.moveaxis(img, -1, 0).astype(np.float32)
  x = _bf16(x * np.float32(cfg.rescale_factor))
  mean = _bf16(np.asarray(cfg.image_mean, np.float32)).reshape(3, 1, 1)
  std = _bf16(np.asarray(cfg.image_std, np.float32)).reshape(3, 1, 1)
  return _bf16(_bf16(x - mean) / std)


# ------------------------------------------------------------------------------------------ pipeline


def to_rgb_uint8(image) -> np.ndarray:
  """HxW (gray), HxWx1, HxWx3 (RGB) or HxWx4 (RGBA, composited on white) uint8 -> HxWx3 uint8."""
  a = np.asarray(image)
  if a.dtype != np.uint8:
    raise ImageInputError(f"image must be uint8 (0..255), got dtype {a.dtype}; convert with "
                          "np.clip(x, 0, 255).astype(np.uint8) or pass the decoded file")
  if a.ndim == 2:
    a = a[:, :, None]
  if a.ndim != 3 or a.shape[2] not in (1, 3, 4):
    raise ImageInputError(f"image must be HxW, HxWx1, HxWx3 or HxWx4 (channels last), got shape {a.shape}")
  if a.shape[0] < 1 or a.shape[1] < 1:
    raise ImageInputError(f"image has an empty side: shape {a.shape}")
  if a.shape[2] == 1:
    return np.repeat(a, 3, axis=2)
  if a.shape[2] == 4:
    return _composite_on_white(a)
  return np.ascontiguousarray(a)


def _composite_on_white(rgba: np.ndarray) -> np.ndarray:
  """PIL ``Image.alpha_composite(white, image)`` as HF's RGB conversion does it: with an opaque white
  background PIL's fixed-point blend equals (c*a + 255*(255-a)) / 255 rounded to nearest, for every
  (c, a) (tests/test_vision_preprocess.py checks all 65536)."""
  c = rgba[:, :, :3].astype(np.int64)
  a = rgba[:, :, 3:4].astype(np.int64)
  return ((c * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)


def preprocess_image(image, cfg: VisionPreprocessConfig = VisionPreprocessConfig()) -> PreprocessedImage:
  """One image (see ``to_rgb_uint8`` for accepted arrays) -> tiles + tile grid, as HF's processor."""
  img = to_rgb_uint8(image)
  t = cfg.tile_size
  hw = img.shape[:2]
  canvas = best_fit(hw, supported_resolutions(cfg.max_tiles, t), cfg.resize_to_max_canvas)
  nh, nw = _resize_target(hw, canvas, t, cfg.resize_to_max_canvas)
  resized = resize_bilinear_uint8(img, nh, nw)
  padded = np.zeros(canvas + (3,), np.uint8)
  padded[:nh, :nw] = resized
  x = _rescale_normalize(padded, cfg)
  rows, cols = canvas[0] // t, canvas[1] // t
  tiles = x.reshape(3, rows, t, cols, t).transpose(1, 3, 0, 2, 4).reshape(rows * cols, 3, t, t)
  if rows * cols > 1:
    thumb = _rescale_normalize(resize_bilinear_uint8(img, t, t), cfg)
    tiles = np.concatenate([tiles, thumb[None]], axis=0)
  return PreprocessedImage(np.ascontiguousarray(tiles, np.float32), (rows, cols))


def preprocess_images(images, cfg: VisionPreprocessConfig = VisionPreprocessConfig()):
  """Several images -> (pixel_values of all their tiles concatenated in order, their tile grids), as
  HF's processor returns them with ``return_tensors`` (``pixel_values`` and ``aspect_ratios``)."""
  if isinstance(images, np.ndarray) and images.ndim == 4:
    images = list(images)
  if not isinstance(images, (list, tuple)) or not images:
    raise ImageInputError("preprocess_images takes a non-empty list of images (HxWx3 uint8 arrays); "
                          "for one image use preprocess_image")
  outs = [preprocess_image(im, cfg) for im in images]
  return np.concatenate([o.pixel_values for o in outs]), [o.tile_grid for o in outs]


# ---------------------------------------------------------------------------------------- prompt text


def image_prompt_tokens(tile_grid: tuple[int, int], cfg: VisionPreprocessConfig = VisionPreprocessConfig()) -> str:
  """The text HF's ``Llama4Processor`` puts in place of one ``<|image|>``: per tile row, the tiles'
  patches separated by ``<|tile_x_separator|>`` and closed by ``<|tile_y_separator|>`` (only when there
  are several tiles), then ``<|image|>`` and the global (or single) tile's patches."""
  rows, cols = tile_grid
  patches = PATCH_TOKEN * cfg.patches_per_tile
  parts = [IMAGE_START]
  if rows * cols > 1:
    for _ in range(rows):
      parts.append(TILE_X_SEPARATOR.join([patches] * cols) + TILE_Y_SEPARATOR)
  parts += [IMAGE_TOKEN, patches, IMAGE_END]
  return "".join(parts)


def expand_image_placeholders(text: str, tile_grids, cfg: VisionPreprocessConfig = VisionPreprocessConfig()) -> str:
  """Replace each ``<|image|>`` in ``text`` (in order) by its image's token layout."""
  pieces = text.split(IMAGE_TOKEN)
  if len(pieces) - 1 != len(tile_grids):
    raise ImageInputError(f"the prompt has {len(pieces) - 1} {IMAGE_TOKEN} placeholders but "
                          f"{len(tile_grids)} images were given; put one {IMAGE_TOKEN} per image")
  out = [pieces[0]]
  for grid, piece in zip(tile_grids, pieces[1:]):
    out += [image_prompt_tokens(grid, cfg), piece]
  return "".join(out)


# ------------------------------------------------------------------------------------------- decoding


def decode_image(source) -> np.ndarray:
  """Image file bytes or a path -> HxWx3 uint8 RGB, converted as HF does (``convert("RGBA")`` then
  composited on white, for every mode but RGB). Needs Pillow: ``pip install maverick-jax[vision]``."""
  try:
    from PIL import Image, UnidentifiedImageError
  except ImportError as e:
    raise ImportError("decoding image files needs Pillow: pip install 'maverick-jax[vision]' "
                      "(or pass an HxWx3 uint8 array to preprocess_image)") from e
  if isinstance(source, (str, os.PathLike)):
    with open(source, "rb") as f:
      data = f.read()
  elif isinstance(source, (bytes, bytearray, memoryview)):
    data = bytes(source)
  else:
    raise ImageInputError(f"decode_image takes file bytes or a path, got {type(source).__name__}")
  try:
    im = Image.open(io.BytesIO(data))
    im.load()
  except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
    raise ImageInputError(f"cannot decode image ({len(data)} bytes): not a readable image file "
                          f"(corrupt or unsupported format): {e}") from e
  if im.mode != "RGB":
    try:
      rgba = im.convert("RGBA")
    except (ValueError, OSError) as e:
      raise ImageInputError(f"unsupported image mode {im.mode!r}: cannot convert to RGB ({e})") from e
    white = Image.new("RGBA", rgba.size, (255, 255, 255))
    im = Image.alpha_composite(white, rgba).convert("RGB")
  return np.asarray(im, np.uint8).copy()
