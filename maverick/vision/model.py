"""The Llama 4 vision tower in Flax NNX: HF ``Llama4VisionModel`` + ``Llama4MultiModalProjector``.

pixel values [N tiles, 3, S, S] -> image features [N * patches_per_tile, text hidden], the rows that
replace the embeddings at the prompt's ``<|patch|>`` positions (in order). Per tile:

1. Patch embedding: unfold into (S/p)^2 patches of 3*p*p values (channel, row, column order as
   torch ``nn.Unfold``), one linear map without bias.
2. A class embedding appended AFTER the patches, the learned positional embedding added, LayerNorm.
3. Encoder layers: pre-LayerNorm attention (biases, bidirectional, 2D RoPE) and a GELU MLP.
4. LayerNorm, drop the class token, pixel shuffle (ratio 0.5: 2x2 neighbouring patches become one
   token of 4x the width), the adapter MLP (fc1, GELU, fc2, GELU; no biases), the projector.

The 2D RoPE rotates interleaved pairs like the text RoPE (``maverick.model.rotate_pairs``): the
first half of the head's pairs by (the patch's column + 1) * f, the second half by (its row + 1) *
f, with head_dim / 4 frequencies f (HF keeps ``[..., ::2]`` of the repeat-interleaved x and y
frequencies); the class token is not rotated. The tower's weights are replicated on a mesh: it is
small (about 0.87 B parameters, 1.7 GB in bf16, for Maverick, next to 400 B of experts), runs once
per image in the prefill, and replication needs no collective there; its logical axes are all None,
so every layout replicates it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maverick.model import attention, rotate_pairs, weight
from maverick.vision.preprocess import VisionPreprocessConfig


class VisionConfigError(ValueError):
  """A vision config that cannot describe a Llama 4 vision tower."""


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """Llama 4 vision tower + projector. Field names follow HF's ``Llama4VisionConfig``; defaults are
  Maverick's (and Scout's)."""

  image_size: int = 336  # the tile size
  patch_size: int = 14
  num_channels: int = 3
  hidden_size: int = 1408
  num_hidden_layers: int = 34
  num_attention_heads: int = 16
  intermediate_size: int = 5632
  pixel_shuffle_ratio: float = 0.5
  projector_input_dim: int = 4096
  projector_output_dim: int = 4096
  vision_output_dim: int = 4096
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  text_hidden_size: int = 5120  # the projector's output
  image_token_id: int = 200092  # <|patch|>: the positions the features replace
  # <|image_start|> / <|image_end|> (HF boi/eoi_token_index): each image's layout in the prompt
  image_start_token_id: int = 200080
  image_end_token_id: int = 200081
  max_tiles: int = 16  # preprocessing: the most local tiles per image (HF max_patches)
  dtype: str = "bfloat16"

  def __post_init__(self):
    for name in ("image_size", "patch_size", "num_channels", "hidden_size", "num_hidden_layers",
                 "num_attention_heads", "intermediate_size", "projector_input_dim",
                 "projector_output_dim", "vision_output_dim", "text_hidden_size", "max_tiles"):
      v = getattr(self, name)
      if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise VisionConfigError(f"vision {name} must be a positive integer, got {v!r}")
    ids = ("image_token_id", "image_start_token_id", "image_end_token_id")
    for name in ids:
      v = getattr(self, name)
      if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
        raise VisionConfigError(f"vision {name} must be a token id (an integer >= 0), got {v!r}")
    if len({getattr(self, n) for n in ids}) != 3:
      raise VisionConfigError(f"vision {', '.join(f'{n} {getattr(self, n)}' for n in ids)} must be "
                              "three different tokens (config.json image_token_index, "
                              "boi_token_index, eoi_token_index)")
    if self.image_size % self.patch_size:
      raise VisionConfigError(f"vision image_size {self.image_size} must be a multiple of "
                              f"patch_size {self.patch_size}")
    if self.hidden_size % self.num_attention_heads or self.head_dim % 4:
      raise VisionConfigError(f"vision hidden_size {self.hidden_size} / num_attention_heads "
                              f"{self.num_attention_heads} must give a head_dim divisible by 4 "
                              "(2D RoPE: a quarter of the pairs per axis)")
    side = self.image_size // self.patch_size
    r = self.pixel_shuffle_ratio
    if not (0 < r <= 1) or (side * r) % 1 or (self.hidden_size / r ** 2) % 1:
      raise VisionConfigError(f"pixel_shuffle_ratio {r} must divide the patch grid {side} and the "
                              f"width {self.hidden_size} evenly")
    if self.intermediate_size != int(self.hidden_size / r ** 2):
      # HF's adapter fc1 reads the pixel-shuffled width through `intermediate_size`
      raise VisionConfigError(f"vision intermediate_size {self.intermediate_size} must equal "
                              f"hidden_size / pixel_shuffle_ratio^2 = {int(self.hidden_size / r ** 2)}")
    if self.projector_output_dim != self.vision_output_dim:
      raise VisionConfigError(f"projector_output_dim {self.projector_output_dim} must equal "
                              f"vision_output_dim {self.vision_output_dim} (the projector's input)")

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_attention_heads

  @property
  def patches(self) -> int:
    """Patches per tile before the class token and the pixel shuffle."""
    return (self.image_size // self.patch_size) ** 2

  @property
  def patches_per_tile(self) -> int:
    """``<|patch|>`` tokens (feature rows) per tile."""
    return int(round(self.patches * self.pixel_shuffle_ratio ** 2))

  def preprocess(self, max_tiles: int | None = None) -> VisionPreprocessConfig:
    """The image preprocessing that matches this tower (tile and patch size, pixel shuffle)."""
    return VisionPreprocessConfig(tile_size=self.image_size, patch_size=self.patch_size,
                                  pixel_shuffle_ratio=self.pixel_shuffle_ratio,
                                  max_tiles=self.max_tiles if max_tiles is None else max_tiles)

  def replace(self, **changes) -> "VisionConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "VisionConfig":
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
      raise VisionConfigError(f"unknown vision config fields {unknown}")
    return cls(**d)


def maverick() -> VisionConfig:
  """Llama-4-Maverick-17B-128E (and Scout): published vision_config values."""
  return VisionConfig()


def tiny(dtype: str = "float32") -> VisionConfig:
  """The vision tower of tests/fixtures/hf_llama4_mm_tiny."""
  return VisionConfig(image_size=56, patch_size=14, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=128, projector_input_dim=48,
                      projector_output_dim=48, vision_output_dim=48, text_hidden_size=64,
                      image_token_id=503, image_start_token_id=500, image_end_token_id=501,
                      max_tiles=4, dtype=dtype)


def from_hf(raw: Mapping[str, Any], dtype: str | None = None) -> VisionConfig | None:
  """The tower of a multimodal HF ``config.json`` (model_type llama4), or None without one."""
  v = raw.get("vision_config")
  if not isinstance(v, Mapping):
    return None
  text = raw.get("text_config") or {}
  act = v.get("hidden_act", "gelu")
  if act != "gelu":
    raise VisionConfigError(f"vision hidden_act {act!r} is not supported (Llama 4 uses 'gelu')")
  rope = v.get("rope_parameters") or {}
  theta = rope.get("rope_theta", v.get("rope_theta", 10000.0))
  hf_dtype = raw.get("dtype", raw.get("torch_dtype", "bfloat16"))
  defaults = VisionConfig()
  get = lambda k: v.get(k, getattr(defaults, k))
  try:
    return VisionConfig(
      image_size=get("image_size"), patch_size=get("patch_size"), num_channels=get("num_channels"),
      hidden_size=get("hidden_size"), num_hidden_layers=get("num_hidden_layers"),
      num_attention_heads=get("num_attention_heads"), intermediate_size=get("intermediate_size"),
      pixel_shuffle_ratio=float(get("pixel_shuffle_ratio")),
      projector_input_dim=get("projector_input_dim"), projector_output_dim=get("projector_output_dim"),
      vision_output_dim=get("vision_output_dim"), norm_eps=float(get("norm_eps")),
      rope_theta=float(theta), text_hidden_size=text.get("hidden_size", defaults.text_hidden_size),
      image_token_id=raw.get("image_token_index", defaults.image_token_id),
      image_start_token_id=raw.get("boi_token_index", defaults.image_start_token_id),
      image_end_token_id=raw.get("eoi_token_index", defaults.image_end_token_id),
      dtype=dtype or (hf_dtype if hf_dtype in ("float32", "bfloat16", "float16") else "bfloat16"))
  except TypeError as e:
    raise VisionConfigError(f"vision_config has a field of the wrong type ({e})") from None


# ----------------------------------------------------------------------------------------------
# Plain functions
# ----------------------------------------------------------------------------------------------
def layer_norm(x, w, b, eps: float):
  """torch LayerNorm: f32 statistics (biased variance), then the affine map."""
  xf = x.astype(jnp.float32)
  mu = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
  y = (xf - mu) * jax.lax.rsqrt(var + eps)
  return (y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def gelu(x):
  return jax.nn.gelu(x, approximate=False)  # torch nn.GELU(): the erf form


def unfold_patches(pixels, patch: int):
  """[N, C, S, S] -> [N, (S/p)^2, C*p*p]: patches row-major, values (channel, row, column) as
  torch ``nn.Unfold(kernel_size=p, stride=p)`` then ``permute(0, 2, 1)``."""
  N, C, H, W = pixels.shape
  x = pixels.reshape(N, C, H // patch, patch, W // patch, patch)
  return x.transpose(0, 2, 4, 1, 3, 5).reshape(N, (H // patch) * (W // patch), C * patch * patch)


@functools.lru_cache(maxsize=16)
def rope_angles(cfg: VisionConfig) -> np.ndarray:
  """[patches + 1, head_dim / 2] float32 rotation angles per (token, pair): the class token (last)
  gets 0. Float32 throughout as HF ``Llama4VisionRotaryEmbedding``."""
  side = cfg.image_size // cfg.patch_size
  idx = np.arange(side * side)
  half = cfg.head_dim // 2  # HF's freq_dim
  freq = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, half, 2)[: half // 2].astype(np.float32)
                                                / np.float32(half)))).astype(np.float32)
  ax = (idx % side + 1).astype(np.float32)[:, None] * freq[None, :]  # column
  ay = (idx // side + 1).astype(np.float32)[:, None] * freq[None, :]  # row
  # HF: cat(repeat_interleave(fx, 2), repeat_interleave(fy, 2))[::2] = cat(fx, fy) per pair
  angles = np.concatenate([ax, ay], axis=-1).astype(np.float32)
  return np.concatenate([angles, np.zeros((1, angles.shape[1]), np.float32)], axis=0)


def pixel_shuffle(x, ratio: float):
  """HF ``pixel_shuffle`` on [N, P, C] (P a square): -> [N, P * r^2, C / r^2]."""
  N, P, C = x.shape
  side = int(round(np.sqrt(P)))
  x = x.reshape(N, side, int(side * ratio), int(C / ratio))
  x = x.transpose(0, 2, 1, 3)
  x = x.reshape(N, int(side * ratio), int(side * ratio), int(C / ratio ** 2))
  x = x.transpose(0, 2, 1, 3)
  return x.reshape(N, -1, x.shape[-1])


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------
def _replicated(rngs, shape, dtype, init="normal", fan_in=None):
  return weight(rngs, shape, (None,) * len(shape), dtype, init=init, fan_in=fan_in)


def _bias(rngs, dim, dtype):
  # small random biases, not zeros: a test on a freshly initialised tower still sees every term
  return nnx.Param((0.02 * jax.random.normal(rngs.params(), (dim,), jnp.float32)).astype(dtype),
                   logical_axes=(None,))


class LayerNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs):
    self.weight = _replicated(rngs, (dim,), dtype, init="ones")
    self.bias = _bias(rngs, dim, dtype)
    self.eps = eps

  def __call__(self, x):
    return layer_norm(x, self.weight[...], self.bias[...], self.eps)


class Linear(nnx.Module):
  """x @ W (+ b): W stored [in, out] as every weight of this library."""

  def __init__(self, din: int, dout: int, dtype, rngs: nnx.Rngs, bias: bool):
    self.weight = _replicated(rngs, (din, dout), dtype)
    self.bias = _bias(rngs, dout, dtype) if bias else None

  def __call__(self, x):
    y = jnp.einsum("...i,io->...o", x, self.weight[...], preferred_element_type=jnp.float32)
    if self.bias is not None:
      y = y + self.bias[...].astype(jnp.float32)
    return y.astype(x.dtype)


class VisionAttention(nnx.Module):

  def __init__(self, cfg: VisionConfig, rngs: nnx.Rngs):
    D, dt = cfg.hidden_size, jnp.dtype(cfg.dtype)
    self.q, self.k, self.v, self.o = (Linear(D, D, dt, rngs, bias=True) for _ in range(4))
    self.config = cfg  # static (hashable): the RoPE angles are a constant in HLO

  def __call__(self, x):
    N, P, _ = x.shape
    cfg = self.config
    split = lambda y: y.reshape(N, P, cfg.num_attention_heads, cfg.head_dim)
    angles = jnp.asarray(rope_angles(cfg))[None]
    q, k = (rotate_pairs(split(p(x)), angles) for p in (self.q, self.k))
    mask = jnp.ones((N, P, P), bool)  # bidirectional within a tile
    out = attention(q, k, split(self.v(x)), mask)
    return self.o(out.reshape(N, P, -1))


class VisionEncoderLayer(nnx.Module):

  def __init__(self, cfg: VisionConfig, rngs: nnx.Rngs):
    D, F, dt = cfg.hidden_size, cfg.intermediate_size, jnp.dtype(cfg.dtype)
    self.input_norm = LayerNorm(D, cfg.norm_eps, dt, rngs)
    self.attn = VisionAttention(cfg, rngs)
    self.post_attn_norm = LayerNorm(D, cfg.norm_eps, dt, rngs)
    self.fc1 = Linear(D, F, dt, rngs, bias=True)
    self.fc2 = Linear(F, D, dt, rngs, bias=True)

  def __call__(self, x):
    x = x + self.attn(self.input_norm(x))
    return x + self.fc2(gelu(self.fc1(self.post_attn_norm(x))))


class VisionTower(nnx.Module):
  """HF ``Llama4VisionModel`` + ``Llama4MultiModalProjector``: pixel values -> text-width features."""

  def __init__(self, cfg: VisionConfig, rngs: nnx.Rngs):
    D, dt = cfg.hidden_size, jnp.dtype(cfg.dtype)
    self.config = cfg
    self.patch_embed = Linear(cfg.num_channels * cfg.patch_size ** 2, D, dt, rngs, bias=False)
    self.class_embedding = _replicated(rngs, (D,), dt, fan_in=D)
    self.positional_embedding = _replicated(rngs, (cfg.patches + 1, D), dt, fan_in=D)
    self.pre_norm = LayerNorm(D, cfg.norm_eps, dt, rngs)
    self.layers = nnx.List([VisionEncoderLayer(cfg, rngs) for _ in range(cfg.num_hidden_layers)])
    self.post_norm = LayerNorm(D, cfg.norm_eps, dt, rngs)
    self.adapter_fc1 = Linear(cfg.intermediate_size, cfg.projector_input_dim, dt, rngs, bias=False)
    self.adapter_fc2 = Linear(cfg.projector_input_dim, cfg.projector_output_dim, dt, rngs,
                              bias=False)
    self.projector = Linear(cfg.vision_output_dim, cfg.text_hidden_size, dt, rngs, bias=False)

  def encode(self, pixel_values):
    """[N, C, S, S] -> [N, patches_per_tile, vision_output_dim]: HF Llama4VisionModel's output."""
    cfg = self.config
    x = self.patch_embed(unfold_patches(pixel_values.astype(cfg.dtype), cfg.patch_size))
    cls = jnp.broadcast_to(self.class_embedding[...], (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([x, cls.astype(x.dtype)], axis=1) + self.positional_embedding[...]
    x = self.pre_norm(x)
    for layer in self.layers:
      x = layer(x)
    x = self.post_norm(x)[:, :-1]  # drop the class token
    x = pixel_shuffle(x, cfg.pixel_shuffle_ratio)
    return gelu(self.adapter_fc2(gelu(self.adapter_fc1(x))))

  def __call__(self, pixel_values):
    """[N, C, S, S] -> [N * patches_per_tile, text_hidden_size]: the rows for the ``<|patch|>``
    positions, tile after tile."""
    feats = self.projector(self.encode(pixel_values))
    return feats.reshape(-1, feats.shape[-1])


def merge_features(embeds, tokens, lengths, features, image_token_id: int):
  """embeds [B, T, D] with the rows at image-token positions (``tokens == image_token_id`` before
  each row's length) replaced by ``features`` [n, D] in row-major order, as HF's ``masked_scatter``
  over the batch. The caller checks that the positions number exactly n (on the host)."""
  T = tokens.shape[1]
  mask = (tokens == image_token_id) & (jnp.arange(T)[None, :] < lengths[:, None])
  idx = jnp.cumsum(mask.reshape(-1).astype(jnp.int32)).reshape(mask.shape) - 1
  rows = jnp.take(features, jnp.clip(idx, 0, features.shape[0] - 1), axis=0)
  return jnp.where(mask[..., None], rows.astype(embeds.dtype), embeds)


PATH = "vision"  # the tower's attribute on the text model, and its checkpoint part


def attach(model, tower: VisionTower):
  """Gives a text model (maverick.model.Llama4) its vision tower: ``model.vision``, part of the
  model's state, so ``maverick.generate(model, prompts, images=...)`` and speculative decoding
  find it. Returns the model."""
  if tower.config.text_hidden_size != model.config.hidden_size:
    raise VisionConfigError(f"the vision tower projects to {tower.config.text_hidden_size} but the "
                            f"text model is {model.config.hidden_size} wide")
  for name in ("image_token_id", "image_start_token_id", "image_end_token_id"):
    if not 0 <= getattr(tower.config, name) < model.config.vocab_size:
      raise VisionConfigError(f"{name} {getattr(tower.config, name)} is outside the "
                              f"vocabulary [0, {model.config.vocab_size})")
  setattr(model, PATH, tower)
  return model


def tower_of(model) -> VisionTower | None:
  """The model's vision tower, or None for a text-only model."""
  return getattr(model, PATH, None)


def init_tower(cfg: VisionConfig, seed: int = 0) -> VisionTower:
  return VisionTower(cfg, nnx.Rngs(params=seed))


def abstract_tower(cfg: VisionConfig) -> VisionTower:
  return nnx.eval_shape(lambda: VisionTower(cfg, nnx.Rngs(params=0)))


@functools.partial(jax.jit, static_argnames=("graphdef",))
def apply(graphdef: nnx.GraphDef, state: nnx.State, pixel_values):
  """The jitted tower over split state (one program per tile count)."""
  return nnx.merge(graphdef, state)(pixel_values)
