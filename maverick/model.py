"""Llama 4 text model in Flax NNX with a functional core.

Modules are thin: each declares its weights once with `weight(...)` (shape, logical axes, init) and calls
plain functions for the math. The weight declarations drive init, sharding (sharding.py reads the
`logical_axes` metadata) and checkpoint restore (abstract state from `nnx.eval_shape`).

Einsum glossary: B batch, T new tokens, S key/cache positions, D model, H query heads, K kv heads,
G query heads per kv head, Dh head dim, F ffn width, E experts, V vocab, N flattened tokens.

Positions: with right-padded prompts and per-row cache lengths, a token's RoPE position, its cache slot
and its temperature-tuning position are the same number, exactly as in HF for unpadded rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maverick import fused_attention
from maverick import kernel_attention
from maverick import kernels as kernels_lib
from maverick import kv_cache as kvc
from maverick import moe
from maverick.quant import config as quant_config
from maverick.quant import contraction
from maverick.quant import ops as quant_lib
from maverick import sharding_plan
from maverick.config import Config
from maverick.moe import swiglu

_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------------------------
# Weight declaration
# ----------------------------------------------------------------------------------------------
def weight(rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], dtype, *,
           init: str = "normal", fan_in: int | None = None) -> nnx.Param:
  """A parameter with its logical axes. init: 'normal' (std 1/sqrt(fan_in)) or 'ones'."""
  assert len(shape) == len(axes), (shape, axes)
  if init == "ones":
    value = jnp.ones(shape, dtype)
  else:
    std = 1.0 / np.sqrt(fan_in if fan_in is not None else shape[0])
    value = (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)
  return nnx.Param(value, logical_axes=tuple(axes))


def linear_weight(rngs: nnx.Rngs, shape: Sequence[int], axes: Sequence[str | None], dtype, *,
                  in_axes: Sequence[int] = (0,), name: str,
                  quant: quant_config.QuantConfig | None, fan_in: int | None = None) -> tuple[nnx.Param, nnx.Param | None]:
  """A weight contracted over `in_axes`, and its scale param or None.

  When `quant` quantizes `name` (see maverick.quant.config) the weight is stored float8_e4m3fn
  and K-major (`quant.to_kmajor`: output axes, then the `in_axes`, as FP8 tensor cores read it;
  its logical axes permuted alike), and the scale is f32 over the output-channel axes, with their
  logical axes, so sharding and restore come from the declarations as for any weight. `shape`,
  `axes` and `in_axes` always describe the declared layout. Otherwise this is `weight`.
  """
  w = weight(rngs, shape, axes, dtype, fan_in=fan_in)
  if quant is None or not quant.quantizes(name):
    return w, None
  q, s = quant_lib.quantize_weight(w[...], in_axes)
  order = quant_lib.kmajor_order(len(shape), in_axes)
  out_axes = tuple(a for i, a in enumerate(axes) if i not in in_axes)
  return (nnx.Param(quant_lib.to_kmajor(q, in_axes), logical_axes=tuple(axes[i] for i in order),
                    fp8_in_axes=tuple(in_axes), quant_name=name),
          nnx.Param(s, logical_axes=out_axes))


def input_scale_param(quant: quant_config.QuantConfig | None, name: str) -> nnx.Param | None:
  """The static activation scale of FP8 weight `name` (f32 scalar, a placeholder 1.0 until a
  checkpoint sets it) when `quant.activations == "static_per_tensor"`, else None."""
  if quant is None or not quant.static_activations or not quant.quantizes(name):
    return None
  return nnx.Param(jnp.ones((), jnp.float32), logical_axes=())


# Attention's static FP8 KV-cache scale params, by the names stored in the model state.
KV_CACHE_SCALES = ("k_cache_scale", "v_cache_scale")


def kv_cache_scale_param(quant: quant_config.QuantConfig | None) -> nnx.Param | None:
  """One layer's static FP8 KV-cache scale (f32 scalar, replicated; a placeholder 1.0 until a
  ModelOpt checkpoint sets it from `k_scale` / `v_scale`) when `quant.kv_cache == "fp8_static"`."""
  if quant is None or not quant.static_kv:
    return None
  return nnx.Param(jnp.ones((), jnp.float32), logical_axes=())


def _value(p):
  return None if p is None else p[...]


def _placement(module, param):
  """(plan, the weight's logical axes as stored) on a sharded model, else None: a kernel call
  then runs on each device's shard of the weight (maverick.kernels)."""
  plan = sharding_plan.plan_of(module)
  return None if plan is None else (plan, param.get_metadata()["logical_axes"])


# ----------------------------------------------------------------------------------------------
# Plain functions
# ----------------------------------------------------------------------------------------------
def rms_norm(x: jax.Array, w: jax.Array | None, eps: float) -> jax.Array:
  """HF Llama RMSNorm: normalise in f32, cast back to x.dtype, THEN multiply by the weight."""
  xf = x.astype(jnp.float32)
  y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
  return y if w is None else y * w


def rope_inv_freq(cfg: Config) -> np.ndarray:
  """Inverse frequencies [Dh/2] in float32, with llama3 scaling chosen by `where`, never blended
  across bands (Scout's low == high factor would give 0/0)."""
  dh = cfg.head_dim
  inv = (1.0 / (np.float32(cfg.rope_theta) ** (np.arange(0, dh, 2, dtype=np.float32) / dh)))
  inv = inv.astype(np.float32)
  rs = cfg.rope_scaling
  if rs is None:
    return inv
  old = np.float32(rs.original_max_position_embeddings)
  lo, hi, factor = np.float32(rs.low_freq_factor), np.float32(rs.high_freq_factor), np.float32(rs.factor)
  wavelen = np.float32(2 * np.pi) / inv
  scaled = np.where(wavelen > old / lo, inv / factor, inv)
  with np.errstate(divide="ignore", invalid="ignore"):
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = (wavelen >= old / hi) & (wavelen <= old / lo)
  return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
  """Interleaved-pair RoPE: (x[2j], x[2j+1]) is one complex number rotated by pos * inv_freq[j]."""
  return rotate_pairs(x, positions.astype(jnp.float32)[..., None] * inv_freq)


def rotate_pairs(x: jax.Array, angles: jax.Array) -> jax.Array:
  """x [B, T, heads, Dh] with (x[2j], x[2j+1]) rotated by angles [B, T, Dh/2] (f32), every head
  alike: the text RoPE and the vision tower's 2D RoPE (maverick.vision.model)."""
  cos = jnp.cos(angles)[:, :, None, :]
  sin = jnp.sin(angles)[:, :, None, :]
  xf = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
  x0, x1 = xf[..., 0], xf[..., 1]
  out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
  return out.reshape(x.shape).astype(x.dtype)


def temperature_scale(positions: jax.Array, floor_scale: float, attn_scale: float) -> jax.Array:
  """Llama 4 NoPE-layer query scale at absolute (cache) positions; note the `p + 1`."""
  p = positions.astype(jnp.float32)
  return jnp.log1p(jnp.floor((p + 1.0) / floor_scale)) * attn_scale + 1.0


def attention_mask(q_pos: jax.Array, kv_pos: jax.Array, chunk_size: int | None) -> jax.Array:
  """[B, T, S] visibility: causal by absolute position; on chunked layers also the same chunk,
  chunks aligned to position 0 (not a sliding window). Negative kv positions are empty slots."""
  q = q_pos[:, :, None]
  kv = kv_pos[:, None, :]
  mask = (kv <= q) & (kv >= 0)
  if chunk_size is not None:
    mask &= (kv // chunk_size) == (q // chunk_size)
  return mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TreeMask:
  """Visibility of a block of cache slots holding a token TREE (speculative verification / tree
  drafting): slots start[b] .. start[b]+R-1 hold tree nodes whose positions are not their slots.
  Slots before `start` are the committed sequence (positional causal + chunk mask); slots after the
  block are invisible; a query sees tree slot r iff visible[b, t, r] (its ancestors and itself)."""
  start: jax.Array  # [B] first slot of the tree block
  positions: jax.Array  # [B, R] absolute positions of the tree slots
  visible: jax.Array  # [B, T, R] bool


def cache_mask(q_pos: jax.Array, num_slots: int, chunk_size: int | None,
               tree: TreeMask | None = None) -> jax.Array:
  """[B, T, S] mask of queries at q_pos over a cache whose slot s holds position s, except for a
  tree block (see TreeMask)."""
  B = q_pos.shape[0]
  slots = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32), (B, num_slots))
  if tree is None:
    return attention_mask(q_pos, slots, chunk_size)
  R = tree.positions.shape[1]
  rel = slots - tree.start[:, None]
  in_tree = (rel >= 0) & (rel < R)
  rel_c = jnp.clip(rel, 0, R - 1)
  kv_pos = jnp.where(in_tree, jnp.take_along_axis(tree.positions, rel_c, axis=1), slots)
  T = q_pos.shape[1]
  tree_vis = jnp.take_along_axis(tree.visible, jnp.broadcast_to(rel_c[:, None, :], (B, T, num_slots)),
                                 axis=2)
  allowed = jnp.where(in_tree[:, None, :], tree_vis, (rel < 0)[:, None, :])
  return attention_mask(q_pos, kv_pos, chunk_size) & allowed


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
              k_scale: jax.Array | None = None, v_scale: jax.Array | None = None) -> jax.Array:
  """GQA attention (XLA reference). q [B,T,H,Dh], k/v [B,S,K,Dh], mask [B,T,S] -> [B,T,H,Dh].
  Query head j uses kv head j // G (HF repeat_kv is repeat_interleave).
  FP8 KV cache: k/v are e4m3 with scales [B,S,K] (dynamic) or scalars (static); the k scale
  multiplies the scores and the v scale the probabilities (what a fused kernel does), never a
  dequantized copy of the cache."""
  B, T, H, Dh = q.shape
  K = k.shape[2]
  q = q.reshape(B, T, K, H // K, Dh)
  if k_scale is not None:
    k = k.astype(q.dtype)
  # Operand order matters on XLA:GPU (jnp.einsum picks it by its own rules): the dot is put in
  # canonical form, lhs [batch, free, contracted] and rhs [batch, contracted, free]. The cache
  # [B, S, K, Dh] (Dh minor) is then read as stored when K is the lhs (contracting Dh) and V the
  # rhs (contracting S): with one kv head per device ([B, K, S, Dh] is a bitcast) no step copies or
  # transposes a whole cache; V as the lhs had each step transpose V to [B, K, Dh, S] and back.
  scores = jax.lax.dot_general(k, q, (((3,), (4,)), ((0, 2), (0, 2))),
                               preferred_element_type=jnp.float32)  # [B, K, S, T, G]
  scores = jnp.transpose(scores, (0, 1, 4, 3, 2))
  if k_scale is not None:
    scores = scores * _per_slot(k_scale)
  scores = scores * (Dh ** -0.5)
  scores = jnp.where(mask[:, None, None], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1)
  if v_scale is not None:
    probs = probs * _per_slot(v_scale)
    v = v.astype(q.dtype)
  probs = probs.astype(v.dtype)
  out = jax.lax.dot_general(probs, v, (((4,), (1,)), ((0, 1), (0, 2))),
                            preferred_element_type=jnp.float32)  # [B, K, G, T, Dh]
  out = jnp.transpose(out, (0, 3, 1, 2, 4))
  return out.reshape(B, T, H, Dh).astype(q.dtype)


def _per_slot(scale: jax.Array) -> jax.Array:
  """A KV scale broadcastable over scores [B,K,G,T,S]: [B,S,K] per token, or a scalar."""
  return scale if scale.ndim == 0 else jnp.transpose(scale, (0, 2, 1))[:, :, None, None, :]


def chunked_self_attention(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int,
                           **kv_scales) -> jax.Array:
  """Chunked causal self-attention for tokens at positions 0..T-1: each chunk of `chunk` tokens
  attends only within itself, so compute as T/chunk independent blocks (T*chunk scores instead of
  T*T). Equal to `attention` with `attention_mask(pos, pos, chunk)` (and the same `kv_scales`)."""
  B, T, H, Dh = q.shape
  n = -(-T // chunk)
  pad = n * chunk - T
  blocks = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2)).reshape(
      B * n, chunk, *x.shape[2:])
  pos = jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (B * n, chunk))
  out = attention(blocks(q), blocks(k), blocks(v), attention_mask(pos, pos, None),
                  **{name: blocks(s) for name, s in kv_scales.items()})
  return out.reshape(B, n * chunk, H, Dh)[:, :T]


# ----------------------------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------------------------
class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype, rngs: nnx.Rngs):
    self.weight = weight(rngs, (dim,), ("norm",), dtype, init="ones")
    self.eps = eps

  def __call__(self, x):
    return rms_norm(x, self.weight[...], self.eps)


class Attention(nnx.Module):
  """Llama 4 attention for one layer. `input_dim` differs from the model width only in the EAGLE-3
  draft layer, whose q/k/v read [embedding; hidden] (2D)."""

  def __init__(self, cfg: Config, layer: int, rngs: nnx.Rngs, input_dim: int | None = None):
    D, H, K, Dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    Din = input_dim or D
    dt = jnp.dtype(cfg.dtype)
    lw = functools.partial(linear_weight, rngs, dtype=dt, quant=cfg.quant)
    n = f"layers.{layer}.attn."
    self.q, self.q_scale = lw((Din, H, Dh), ("embed", "q_heads", "head_dim"), name=n + "q")
    self.k, self.k_scale = lw((Din, K, Dh), ("embed", "kv_heads", "head_dim"), name=n + "k")
    self.v, self.v_scale = lw((Din, K, Dh), ("embed", "kv_heads", "head_dim"), name=n + "v")
    self.o, self.o_scale = lw((H, Dh, D), ("q_heads", "head_dim", "embed"), in_axes=(0, 1),
                              fan_in=H * Dh, name=n + "o")
    for p in "qkvo":
      setattr(self, f"{p}_input_scale", input_scale_param(cfg.quant, n + p))
    # Static FP8 KV cache: the calibrated per-layer scales (`k_scale` above is the k projection's
    # weight scale).
    self.k_cache_scale = kv_cache_scale_param(cfg.quant)
    self.v_cache_scale = kv_cache_scale_param(cfg.quant)
    self.quant = cfg.quant
    self.use_rope = cfg.uses_rope(layer)
    self.qk_norm = cfg.use_qk_norm and self.use_rope
    self.temperature_tuning = cfg.attn_temperature_tuning and not self.use_rope
    self.chunk_size = cfg.attention_chunk_size if cfg.is_chunked(layer) else None
    self.eps = cfg.rms_norm_eps
    self.floor_scale, self.attn_scale = cfg.floor_scale, cfg.attn_scale
    self.inv_freq = tuple(float(f) for f in rope_inv_freq(cfg))  # static: a constant in HLO
    self.kernels = None  # see maverick.kernels

  def __call__(self, x_btd, positions_bt, layer_cache=None, cache_lengths=None, *,
               attend_to_cache: bool = True, positions_from_zero: bool = False,
               attention_fn=None, tree: TreeMask | None = None, fuse=None, block_table=None):
    """Returns (output [B,T,D], (k_cache, v_cache) or None; for an FP8 cache (`layer_cache` of
    4: k, v, k_scale, v_scale) the 4-tuple, new entries quantized per token and kv head).
    Static FP8 KV (`k_cache_scale` set): the cache is (k, v) in e4m3 quantized with the layer's
    scalar scales, and every attention, with or without a cache, reads K/V as stored, i.e.
    e4m3(clip(x / scale)) * scale (as vLLM, which attends to its FP8 cache in prefill too); so a
    prefill-then-decode run equals one forward. Dynamic FP8 KV alike wherever the layer writes its
    cache: a prefill (attend_to_cache=False) attends among the new tokens to their e4m3 K/V with
    the per-token scales on scores and probabilities, the math of a prefix hit or decode step (the
    Pallas prefill kernel gets them dequantized); without a cache K/V stay raw.

    With a cache, the new keys/values are written at slots cache_lengths[b] + t. `attend_to_cache=False`
    (prefill into an empty cache) attends among the new tokens only, avoiding a T x capacity score
    matrix. `positions_from_zero` declares positions == arange(T) in every row, which lets chunked
    layers compute block by block. `attention_fn(q, k, v) -> out` replaces the attention itself
    (EAGLE-3 training-time test attends across unrolled steps). `tree`: the cache holds a token
    tree (see TreeMask). `fuse` (maverick.kernels.Fuse): the o projection's all-reduce fused
    with the residual add and the next norm; the output is then (new residual, normed) where the
    site fuses (see DecoderLayer). `block_table` [B, M]: the cache is paged (kv_cache.PagedKVCache:
    `layer_cache` holds the block pools); new entries are scattered through the table; the decode
    kernel reads the pools through the table, the XLA path the gathered contiguous view."""
    if layer_cache is not None and attend_to_cache and attention_fn is None:
      fused = self._fused_decode(x_btd, positions_bt, layer_cache, cache_lengths, block_table,
                                 tree)
      if fused is not None:
        out, new_cache = fused
        return self.output(out, fuse), new_cache
    q, k, v = self.project(x_btd, positions_bt)
    static_scales, new_scales = None, {}
    if self.k_cache_scale is not None:
      static_scales = dict(k_scale=self.k_cache_scale[...], v_scale=self.v_cache_scale[...])
      kq = quant_lib.quantize_static(k, static_scales["k_scale"])
      vq = quant_lib.quantize_static(v, static_scales["v_scale"])
      k = quant_lib.dequantize(kq, static_scales["k_scale"], (), k.dtype)
      v = quant_lib.dequantize(vq, static_scales["v_scale"], (), v.dtype)
    if attention_fn is not None:
      return self.output(attention_fn(q, k, v), fuse), None
    new_cache = None
    if layer_cache is not None:
      new = (k, v)
      if len(layer_cache) == 4:  # FP8 cache: (k, v, k_scale, v_scale), written quantized
        (kq, ks), (vq, vs) = quant_lib.quantize_kv(k), quant_lib.quantize_kv(v)
        new = (kq, vq, ks, vs)
        k, v, new_scales = kq, vq, dict(k_scale=ks, v_scale=vs)  # read as stored (docstring)
      elif layer_cache[0].dtype == quant_lib.FP8:
        if static_scales is None:
          raise ValueError("an FP8 KV cache without per-token scales needs a model with static KV "
                           "scales (quant kv_cache 'fp8_static'); build the cache with "
                           "KVCache.init(model.config, ...)")
        new = (kq, vq)
      if block_table is None:
        new_cache = tuple(kvc.write(c, x, cache_lengths) for c, x in zip(layer_cache, new))
      else:
        new_cache = tuple(kvc.write_paged(c, x, cache_lengths, block_table)
                          for c, x in zip(layer_cache, new))
      view = new_cache  # paged: the pools, which the kernel reads through the block table
      if attend_to_cache:
        kv_scales = {}
        if len(view) == 4:
          kv_scales = dict(k_scale=view[2], v_scale=view[3])
        elif view[0].dtype == quant_lib.FP8:
          kv_scales = static_scales
        out = kernel_attention.cache_attention(q, view[0], view[1], positions_bt,
                                          self.chunk_size, tree, kv_scales, self.kernels,
                                          sharding_plan.plan_of(self), block_table,
                                          quantize_for=self._o_quantize_for())
        if out is None:
          if block_table is not None:  # XLA reads the gathered contiguous view
            view = tuple(kvc.gather(c, block_table) for c in new_cache)
            kv_scales = dict(k_scale=view[2], v_scale=view[3]) if len(view) == 4 else kv_scales
          mask = cache_mask(positions_bt, view[0].shape[1], self.chunk_size, tree)
          out = attention(q, view[0], view[1], mask, **kv_scales)
        return self.output(out, fuse), new_cache
    if tree is not None:
      raise ValueError("a tree mask needs a KV cache to attend to")
    T = x_btd.shape[1]
    if positions_from_zero:
      deq = lambda x, s: x if s is None else quant_lib.dequantize(x, s, (-1,), q.dtype)
      out = kernel_attention.prefill_attention(q, deq(k, new_scales.get("k_scale")),
                                          deq(v, new_scales.get("v_scale")), self.chunk_size,
                                          self.kernels, sharding_plan.plan_of(self))
      if out is not None:
        return self.output(out, fuse), new_cache
    if positions_from_zero and self.chunk_size is not None and T > self.chunk_size:
      out = chunked_self_attention(q, k, v, self.chunk_size, **new_scales)
    else:
      out = attention(q, k, v, attention_mask(positions_bt, positions_bt, self.chunk_size),
                      **new_scales)
    return self.output(out, fuse), new_cache

  def _fused_decode(self, x_btd, positions_bt, layer_cache, cache_lengths, block_table, tree):
    """The kernel path's decode / verify attention in four launches (maverick.fused_attention),
    or None."""
    if self.kernels == "xla":
      return None
    static = None
    if self.k_cache_scale is not None:
      static = (self.k_cache_scale[...], self.v_cache_scale[...])
    ws = (self.q, self.k, self.v)
    return fused_attention.decode_attention(
        self, x_btd, positions_bt, layer_cache, cache_lengths, block_table, tree, static,
        tuple(_placement(self, w) for w in ws), tuple(w[...] for w in ws),
        tuple(_value(s) for s in (self.q_scale, self.k_scale, self.v_scale)),
        tuple(_value(i) for i in (self.q_input_scale, self.k_input_scale, self.v_input_scale)))

  def project(self, x_btd, positions_bt):
    """q [B,T,H,Dh] and k, v [B,T,K,Dh] with RoPE, QK norm and temperature tuning applied."""
    ws = (self.q, self.k, self.v)
    q, k, v = contraction.einsum_many(
        "btd,dhk->bthk", x_btd, tuple(w[...] for w in ws),
        tuple(_value(s) for s in (self.q_scale, self.k_scale, self.v_scale)), self.quant,
        kernels=self.kernels, placements=tuple(_placement(self, w) for w in ws),
        input_scales=tuple(_value(i) for i in (self.q_input_scale, self.k_input_scale,
                                                self.v_input_scale)))
    if self.use_rope:
      inv_freq = jnp.asarray(self.inv_freq, jnp.float32)
      q = apply_rope(q, positions_bt, inv_freq)
      k = apply_rope(k, positions_bt, inv_freq)
    if self.qk_norm:  # weightless RMS norm after RoPE (not a unit L2 norm)
      q = rms_norm(q, None, self.eps)
      k = rms_norm(k, None, self.eps)
    if self.temperature_tuning:  # query only, by cache position
      scale = temperature_scale(positions_bt, self.floor_scale, self.attn_scale)
      q = (q.astype(jnp.float32) * scale[:, :, None, None]).astype(q.dtype)
    return q, k, v

  def _o_quantize_for(self):
    """(N, ub) when o is an FP8 GEMM that quantizes its input per token (the attention kernel
    then writes those rows: `kernel_attention.cache_attention`), else None."""
    ub = kernels_lib.fp8_input_ub(self.quant)
    if ub is None or _value(self.o_scale) is None or _value(self.o_input_scale) is not None:
      return None
    return self.o[...].shape[0], ub  # FP8: stored K-major, [D, H, Dh]

  def output(self, out_bthk, fuse=None):
    return contraction.einsum("bthk,hkd->btd", out_bthk, self.o[...], _value(self.o_scale),
                              self.quant, kernels=self.kernels, placement=_placement(self, self.o),
                              input_scale=_value(self.o_input_scale), fuse=fuse)


class MLP(nnx.Module):
  """SwiGLU: dense layers use intermediate_size_mlp, the shared expert intermediate_size."""

  def __init__(self, dim: int, width: int, dtype, rngs: nnx.Rngs, axis: str = "mlp", *,
               quant: quant_config.QuantConfig | None = None, name: str = ""):
    """quant/name: the model's quant config and this MLP's weight-name prefix (FP8 storage)."""
    lw = functools.partial(linear_weight, rngs, dtype=dtype, quant=quant)
    self.gate, self.gate_scale = lw((dim, width), ("embed", axis), name=name + "gate")
    self.up, self.up_scale = lw((dim, width), ("embed", axis), name=name + "up")
    self.down, self.down_scale = lw((width, dim), (axis, "embed"), name=name + "down")
    for p in ("gate", "up", "down"):
      setattr(self, f"{p}_input_scale", input_scale_param(quant, name + p))
    self.quant = quant
    self.kernels = None  # see maverick.kernels

  def input_scales(self):
    return tuple(_value(getattr(self, f"{p}_input_scale")) for p in ("gate", "up", "down"))

  def __call__(self, x, fuse=None):
    """`fuse`: see DecoderLayer (the down projection's all-reduce)."""
    scales = (_value(self.gate_scale), _value(self.up_scale), _value(self.down_scale))
    placements = tuple(_placement(self, w) for w in (self.gate, self.up, self.down))
    return swiglu(x, self.gate[...], self.up[...], self.down[...], scales, self.quant,
                  self.kernels, placements, self.input_scales(), fuse=fuse)


class MoE(nnx.Module):

  def __init__(self, cfg: Config, rngs: nnx.Rngs, impl: str = "tiles", layer: int = 0):
    D, F, E = cfg.hidden_size, cfg.intermediate_size, cfg.num_local_experts
    dt = jnp.dtype(cfg.dtype)
    lw = functools.partial(linear_weight, rngs, dtype=dt, quant=cfg.quant)
    n = f"layers.{layer}."
    self.router, self.router_scale = lw((D, E), ("embed", None), name=n + "router")
    ex = ("experts", "embed", "expert_mlp")
    self.gate, self.gate_scale = lw((E, D, F), ex, in_axes=(1,), fan_in=D, name=n + "experts.gate")
    self.up, self.up_scale = lw((E, D, F), ex, in_axes=(1,), fan_in=D, name=n + "experts.up")
    self.down, self.down_scale = lw((E, F, D), ("experts", "expert_mlp", "embed"), in_axes=(1,),
                                    fan_in=F, name=n + "experts.down")
    self.shared = MLP(D, F, dt, rngs, axis="expert_mlp", quant=cfg.quant, name=n + "shared.")
    self.router_input_scale = input_scale_param(cfg.quant, n + "router")
    for p in ("gate", "up", "down"):
      setattr(self, f"{p}_input_scale", input_scale_param(cfg.quant, n + "experts." + p))
    self.quant = cfg.quant
    self.top_k = cfg.num_experts_per_tok
    if impl not in moe.MOE_IMPLS:
      raise ValueError(f"unknown moe_impl {impl!r}; choose one of {moe.MOE_IMPLS}")
    self.impl = impl
    self.record_balance_loss = False  # training: model.set_attributes(record_balance_loss=True)
    self.kernels = None  # see maverick.kernels

  def __call__(self, x_btd, fuse=None):
    """`fuse`: see DecoderLayer (the sharded MoE's closing all-reduce)."""
    B, T, D = x_btd.shape
    x = x_btd.reshape(B * T, D)
    kernels_lib.carry_quantized(x_btd, x)
    scales = (_value(self.gate_scale), _value(self.up_scale), _value(self.down_scale))
    input_scales = tuple(_value(getattr(self, f"{p}_input_scale")) for p in ("gate", "up", "down"))
    plan = sharding_plan.plan_of(self)  # set by sharding.shard_model
    if plan is not None and not self.record_balance_loss:
      shared = (self.shared.gate[...], self.shared.up[...], self.shared.down[...])
      shared_scales = (_value(self.shared.gate_scale), _value(self.shared.up_scale),
                       _value(self.shared.down_scale))
      y = moe.sharded_moe(plan, x, self.router[...], self.gate[...], self.up[...],
                          self.down[...], shared, top_k=self.top_k, impl=self.impl,
                          router_scale=_value(self.router_scale), scales=scales,
                          shared_scales=shared_scales, quant=self.quant,
                          kernels=self.kernels,
                          router_input_scale=_value(self.router_input_scale),
                          input_scales=input_scales,
                          shared_input_scales=self.shared.input_scales(),
                          fuse=None if fuse is None else dataclasses.replace(
                              fuse, residual=fuse.residual.reshape(B * T, D)))
      if fuse is not None:
        h, normed = (a.reshape(B, T, D) for a in y)
        kernels_lib.carry_quantized(y[1], normed)
        return h, normed
      return y.reshape(B, T, D)
    top_idx, scores, logits = moe.route(x, self.router[...], self.top_k,
                                        router_scale=_value(self.router_scale), quant=self.quant,
                                        router_input_scale=_value(self.router_input_scale))
    if self.record_balance_loss:
      self.sow(nnx.Intermediate, "balance_loss", moe.load_balancing_loss(logits, top_idx))
    routed = moe.moe_experts(x, top_idx, scores, self.gate[...], self.up[...], self.down[...],
                             impl=self.impl, scales=scales, quant=self.quant,
                             kernels=self.kernels, input_scales=input_scales)
    return (self.shared(x) + routed).reshape(B, T, D)


class DecoderLayer(nnx.Module):
  """Pre-norm block: x += attn(norm(x)); x += ffn(norm(x)). Shared with the EAGLE-3 draft layer."""

  def __init__(self, cfg: Config, layer: int, rngs: nnx.Rngs, moe_impl: str = "tiles",
               attn_input_dim: int | None = None):
    """attn_input_dim: the EAGLE-3 draft layer's attention reads a caller-built, already normed
    [embedding; hidden] input of this width, so the layer has no input norm of its own."""
    dt = jnp.dtype(cfg.dtype)
    if attn_input_dim is None:
      self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, rngs)
    self.attn = Attention(cfg, layer, rngs, input_dim=attn_input_dim)
    self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, rngs)
    if cfg.is_moe(layer):
      self.ffn = MoE(cfg, rngs, impl=moe_impl, layer=layer)
    else:
      self.ffn = MLP(cfg.hidden_size, cfg.intermediate_size_mlp, dt, rngs, quant=cfg.quant,
                     name=f"layers.{layer}.mlp.")

  def __call__(self, x, positions, layer_cache=None, cache_lengths=None, *, attend_to_cache=True,
               positions_from_zero=False, attn_input=None, attention_fn=None, tree=None,
               next_norm: RMSNorm | None = None, block_table=None, next_quant=None):
    """Returns (x, layer_cache), or with `next_norm` (the next layer's input norm, or the final
    norm) (x, layer_cache, next_norm(x) or None). `attn_input`: the normed input when the caller
    has it (the previous layer's third output, or the EAGLE-3 draft's [embedding; hidden]).

    On a sharded model's kernel path (`kernels_lib.fuses_residual_norm`) each row-parallel site
    ends in one fused all-reduce + residual add + RMSNorm: o -> x + a -> post_attn_norm, and FFN
    down (MoE: routed + shared) -> x + f -> `next_norm`; otherwise (and for a site without a norm
    after it) the plain residual add and norm, the same math. A fused site whose next GEMMs take
    FP8 rows quantized per token (this layer's FFN; the next layer's q/k/v, under `next_quant`,
    the next layer's quant config) quantizes the normed rows for them in the same kernel."""
    h = self.input_norm(x) if attn_input is None else attn_input
    fusing = kernels_lib.fuses_residual_norm(sharding_plan.plan_of(self.attn), self.attn.kernels)
    fuse = lambda residual, norm, quant: (
        kernels_lib.Fuse(residual, norm.weight[...], norm.eps, self.attn.kernels,
                         kernels_lib.fp8_input_ub(quant))
        if fusing and norm is not None else None)
    a, layer_cache = self.attn(h, positions, layer_cache, cache_lengths,
                               attend_to_cache=attend_to_cache,
                               positions_from_zero=positions_from_zero, attention_fn=attention_fn,
                               tree=tree, fuse=fuse(x, self.post_attn_norm, self.attn.quant),
                               block_table=block_table)
    x, h = _residual_norm(x, a, self.post_attn_norm)
    x, h = _residual_norm(x, self.ffn(h, fuse=fuse(x, next_norm, next_quant)), next_norm)
    return (x, layer_cache) if next_norm is None else (x, layer_cache, h)


def _residual_norm(x, out, norm):
  """(x + out, norm(x + out) or None), or `out` itself when the site fused them."""
  if isinstance(out, tuple):
    return out
  x = x + out
  return x, None if norm is None else norm(x)


def token_positions(tokens_bt, positions_bt, cache, prefill: bool, tree=None):
  """Positions of new tokens: cache slots when there is a cache (the given positions for a token
  tree), else the given positions or arange(T). Also whether they are known to be arange(T) in
  every row (chunked layers can then compute block by block)."""
  B, T = tokens_bt.shape
  if tree is not None:
    if cache is None or positions_bt is None or prefill:
      raise ValueError("a token tree needs a cache and explicit positions (not prefill)")
    return positions_bt, False
  from_zero = prefill or (cache is None and positions_bt is None)
  if cache is not None:
    positions_bt = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  elif positions_bt is None:
    positions_bt = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  return positions_bt, from_zero


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ForwardOutput:
  logits: jax.Array  # [B, T, V], or [B, V] when `logits_at` is given
  cache: kvc.KVCache | None
  hidden: jax.Array | None  # [n_capture, B, T, D] residual-stream outputs of the requested layers


class Llama4(nnx.Module):
  """The Llama 4 text model (Llama4ForCausalLM)."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs, moe_impl: str = "tiles"):
    dt = jnp.dtype(cfg.dtype)
    self.config = cfg
    # std 1/sqrt(D): as the (tied) output projection this gives unit-scale initial logits.
    self.embed, self.embed_scale = linear_weight(
        rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dt, in_axes=(1,),
        fan_in=cfg.hidden_size, name="embed", quant=cfg.quant)
    self.layers = nnx.List([DecoderLayer(cfg, i, rngs, moe_impl)
                            for i in range(cfg.num_hidden_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt, rngs)
    self.kernels = None  # see maverick.kernels
    if not cfg.tie_word_embeddings:
      self.lm_head, self.lm_head_scale = linear_weight(
          rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), dt, name="lm_head",
          quant=cfg.quant)

  def embed_tokens(self, tokens_bt):
    rows = jnp.take(self.embed[...], tokens_bt, axis=0)
    if self.embed_scale is None:
      return rows
    scale = jnp.take(self.embed_scale[...], tokens_bt, axis=0)[..., None]
    return (rows.astype(jnp.float32) * scale).astype(self.config.dtype)

  def embed_normed(self, tokens_bt):
    """(embedding rows, the first layer's input norm of them) from the fused site on a sharded
    model's kernel path (maverick.kernels.sharded_embed_norm: no all-reduce of GSPMD's own);
    elsewhere (rows, None), and the layer norms them."""
    plan = sharding_plan.plan_of(self)
    if kernels_lib.fuses_residual_norm(plan, self.kernels):
      norm = self.layers[0].input_norm
      out = kernels_lib.sharded_embed_norm(
          tokens_bt, self.embed[...], _value(self.embed_scale), norm.weight[...], norm.eps,
          self.kernels, plan, self.embed.get_metadata()["logical_axes"],
          jnp.dtype(self.config.dtype), kernels_lib.fp8_input_ub(self.layers[0].attn.quant))
      if out is not None:
        return out
    return self.embed_tokens(tokens_bt), None

  def output_projection(self) -> jax.Array:
    """The [D, V] output projection in the model dtype, dequantized if FP8 (stored [V, D])."""
    w, scale = ((self.embed, self.embed_scale) if self.config.tie_word_embeddings
                else (self.lm_head, self.lm_head_scale))
    if scale is not None:
      return quant_lib.dequantize(w[...], scale[...], (1,), jnp.dtype(self.config.dtype)).T
    return w[...].T if self.config.tie_word_embeddings else w[...]

  def logits(self, x_btd, normed=None):
    """float32 logits: sampling and argmax decide on f32 values (bf16 rounding makes near-ties
    exact ties, broken differently under different batch sizes). `normed`: final_norm(x_btd) when
    the caller has it (the last layer's fused site)."""
    x = self.final_norm(x_btd) if normed is None else normed
    q = self.config.quant
    if self.config.tie_word_embeddings:
      return contraction.einsum("...d,vd->...v", x, self.embed[...], _value(self.embed_scale), q,
                                out_dtype=jnp.float32, kernels=self.kernels,
                                placement=_placement(self, self.embed))
    return contraction.einsum("...d,dv->...v", x, self.lm_head[...], _value(self.lm_head_scale), q,
                              out_dtype=jnp.float32, kernels=self.kernels,
                              placement=_placement(self, self.lm_head))

  @kernels_lib.fused_forward()  # what the forward's fused all-reduce sites share
  def __call__(self, tokens_bt, positions_bt=None,
               cache: kvc.KVCache | kvc.PagedKVCache | None = None, *,
               capture_layers: Sequence[int] = (), logits_at: jax.Array | None = None,
               prefill: bool = False, tree: TreeMask | None = None,
               input_embeds: jax.Array | None = None) -> ForwardOutput:
    """One forward over T new tokens per row.

    Without a cache: positions default to arange(T). With a cache: the tokens go to slots
    cache.lengths[b] + t (their positions) and the returned cache has lengths + T; `prefill=True`
    declares the cache empty, so attention runs among the new tokens only.
    `capture_layers`: layer indices whose residual-stream outputs are returned (EAGLE-3 features),
    taken in the same pass. `logits_at` [B]: return logits only at these time indices.
    `tree`: the new tokens form a token tree (speculative verification): they are written at slots
    cache.lengths[b] + t but sit at `positions_bt` and see the cache through the TreeMask.
    `input_embeds` [B, T, D]: the input rows instead of the embeddings of `tokens_bt` (image
    prompts: the vision tower's features at the image-token positions, maverick.generation).
    """
    T = tokens_bt.shape[1]
    positions_bt, from_zero = token_positions(tokens_bt, positions_bt, cache, prefill, tree)
    capture = tuple(int(i) for i in capture_layers)
    L = len(self.layers)
    if any(not 0 <= i < L for i in capture):
      raise ValueError(f"capture_layers {capture} outside 0..{L - 1}")

    # h: the next layer's normed input, when a fused site produced it with the residual
    x, h = self.embed_normed(tokens_bt) if input_embeds is None else (input_embeds, None)
    captured = {}
    new_k, new_v, new_scales = [], [], []
    for i, layer in enumerate(self.layers):
      layer_cache = None if cache is None else cache.layer(i)
      lengths = None if cache is None else cache.lengths
      next_norm = self.layers[i + 1].input_norm if i + 1 < L else self.final_norm
      x, layer_cache, h = layer(x, positions_bt, layer_cache, lengths,
                                attend_to_cache=not prefill, positions_from_zero=from_zero,
                                tree=tree, attn_input=h, next_norm=next_norm,
                                block_table=None if cache is None else cache.table(i),
                                next_quant=self.layers[i + 1].attn.quant if i + 1 < L else None)
      if layer_cache is not None:
        new_k.append(layer_cache[0])
        new_v.append(layer_cache[1])
        new_scales.append(layer_cache[2:])
      if i in capture:
        captured[i] = x
    if logits_at is not None:
      at = lambda a: jnp.take_along_axis(a, logits_at[:, None, None].astype(jnp.int32),
                                         axis=1)[:, 0]
      x, h = at(x), None if h is None else at(h)
    new_cache = None
    if cache is not None:
      new_cache = cache.replaced(new_k, new_v, new_scales, cache.lengths + T)
    hidden = jnp.stack([captured[i] for i in capture]) if capture else None
    return ForwardOutput(logits=self.logits(x, h), cache=new_cache, hidden=hidden)


def init_model(cfg: Config, seed: int = 0, moe_impl: str = "tiles") -> Llama4:
  return Llama4(cfg, nnx.Rngs(params=seed), moe_impl=moe_impl)


def num_params(cfg: Config) -> int:
  _, state = nnx.split(abstract_model(cfg))
  return sum(int(np.prod(v.shape)) for _, v in nnx.to_flat_state(state))


def abstract_model(cfg: Config, moe_impl: str = "tiles") -> Llama4:
  """The model with ShapeDtypeStruct leaves: no memory, used for restore and planning."""
  return nnx.eval_shape(lambda: Llama4(cfg, nnx.Rngs(params=0), moe_impl=moe_impl))


@functools.partial(jax.jit, static_argnames=("graphdef", "capture_layers", "prefill"))
def apply(graphdef: nnx.GraphDef, state: nnx.State, tokens_bt, positions_bt=None, cache=None, *,
          capture_layers: tuple[int, ...] = (), logits_at=None, prefill: bool = False,
          tree: TreeMask | None = None) -> ForwardOutput:
  """The jitted pure forward over split state: `apply(*nnx.split(model), tokens, ...)`."""
  return nnx.merge(graphdef, state)(tokens_bt, positions_bt, cache, capture_layers=capture_layers,
                                    logits_at=logits_at, prefill=prefill, tree=tree)
