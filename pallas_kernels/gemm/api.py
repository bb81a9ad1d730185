"""`gemm`: x @ w.T with optional per-row (token) and per-column (output channel) scales, f32
accumulation, the scales applied to the accumulator in the epilogue. bf16 x bf16, or e4m3 x e4m3
(the FP8 path of quantized layers). Weights are (N, K): K-major, as FP8 tensor cores need."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.common import check
from pallas_kernels.gemm import reference, sm90, sm100

FP8 = jnp.dtype(jnp.float8_e4m3fn)
BF16 = jnp.dtype(jnp.bfloat16)
_SUPPORTED = ((BF16, BF16), (FP8, FP8))
# A K step is one swizzle row of 128 bytes, or 64/32 for narrow K (32 bytes = one wgmma K step).
TILE_K_BYTES = (128, 64, 32)
_KERNELS = {"sm90": sm90.gemm, "sm100": sm100.gemm}


def _validate(x, w, x_scale, w_scale, out_dtype, w_layout):
  check(w_layout in ("nk", "kn"), f"gemm: w_layout={w_layout!r}; use 'nk' (K-major) or 'kn'")
  check(x.ndim >= 1 and w.ndim == 2,
        f"gemm takes x [..., K] and w [N, K] (w_layout='nk') or [K, N] ('kn'); got x {x.shape}, "
        f"w {w.shape}")
  k_axis = 1 if w_layout == "nk" else 0
  check(x.shape[-1] == w.shape[k_axis],
        f"gemm: x {x.shape} and w {w.shape} disagree on K (x's last axis, w's axis {k_axis} for "
        f"w_layout={w_layout!r})")
  if x_scale is not None:
    check(x_scale.shape == x.shape[:-1],
          f"gemm: x_scale has shape {x_scale.shape}; it must be one scale per row of x, shape "
          f"{x.shape[:-1]}")
  if w_scale is not None:
    n = w.shape[0] if w_layout == "nk" else w.shape[1]
    check(w_scale.shape == (n,),
          f"gemm: w_scale has shape {w_scale.shape}; it must be one scale per output channel, "
          f"shape ({n},)")
  check(jnp.dtype(out_dtype) in (BF16, jnp.dtype(jnp.float32), jnp.dtype(jnp.float16)),
        f"gemm: out_dtype={jnp.dtype(out_dtype)}; use bfloat16, float16 or float32")
  for name, a in (("x", x), ("w", w)):
    check(jnp.issubdtype(a.dtype, jnp.floating),
          f"gemm: {name} has dtype {a.dtype}; it must be a float (bf16 or float8_e4m3fn)")


def _tiles(m: int, n: int, k: int, dtype, kn: bool):
  """(tile_m, tile_n, tile_k, wg_split) for the problem, or None when no tiling fits. Decode
  (M <= 64) prefers the WGs splitting N; otherwise they split M. A (K, N) weight tile is swizzled
  along N and the x tile along K: wgmma needs both swizzles equal, which ties tile_k to tile_n."""
  item = jnp.dtype(dtype).itemsize
  decode = m <= 64
  for split in (("n", "m") if decode else ("m",)):
    for tile_n in ((64, 32, 16) if split == "n" else (128, 64, 32, 16)):
      if n % (tile_n * (2 if split == "n" else 1)):
        continue
      if kn:
        tile_ks = [min(128, tile_n * item) // item]
      else:
        tile_ks = [b // item for b in TILE_K_BYTES]
      for tile_k in tile_ks:
        if k % tile_k == 0 and tile_k * item >= 32:
          return (64 if m <= 128 else 128), tile_n, tile_k, split
  return None


def pallas_support(x_dtype, w_dtype, n: int, k: int, w_layout: str = "nk") -> tuple[bool, str]:
  """(supported, why not) for the Pallas kernel."""
  pair = (jnp.dtype(x_dtype), jnp.dtype(w_dtype))
  if pair not in _SUPPORTED:
    return False, (f"dtypes x {pair[0]}, w {pair[1]}: the kernel takes bf16 x bf16 or e4m3 x e4m3 "
                   f"(quantize x per token for FP8 weights)")
  if w_layout == "kn" and pair[1].itemsize == 1:
    return False, ("FP8 tensor cores take only K-major weights: store the FP8 weight as (N, K) "
                   "and pass w_layout='nk'")
  min_k = TILE_K_BYTES[-1] // pair[0].itemsize
  if k % min_k:
    return False, f"K={k} must be a multiple of {min_k} (32 bytes of {pair[0]})"
  if n % 16:
    return False, f"N={n} must be a multiple of 16"
  if _tiles(128, n, k, pair[0], w_layout == "kn") is None:
    return False, (f"N={n}, K={k} with w stored (K, N): K must be a multiple of the N tile "
                   f"(16..64 elements) that divides N")
  return True, ""


def default_config(m: int, n: int, k: int, dtype, w_layout: str = "nk") -> sm90.Config:
  """Tiles from `_tiles`; 4 pipeline stages for 64-row tiles, 3 for 128 (SMEM); split-K until
  every SM has work (decode: the weight stream is the whole cost)."""
  tile_m, tile_n, tile_k, split = _tiles(m, n, k, dtype, w_layout == "kn")
  cfg = sm90.Config(tile_m, tile_n, tile_k, stages=4 if tile_m == 64 else 3, wg_split=split,
                    w_kn=w_layout == "kn")
  k_steps = k // tile_k
  tiles = math.ceil(m / cfg.cta_m) * (n // cfg.cta_n)
  splits = 1
  while (tiles * splits < common.num_sms() and k_steps % (2 * splits) == 0
         and k_steps // (2 * splits) >= cfg.stages):
    splits *= 2
  return dataclasses.replace(cfg, k_splits=splits)


def gemm(x: jax.Array, w: jax.Array, x_scale: jax.Array | None = None,
         w_scale: jax.Array | None = None, *, out_dtype=jnp.bfloat16,
         w_layout: str = "nk", implementation: str | None = None,
         config: sm90.Config | None = None) -> jax.Array:
  """(x @ w.T) * x_scale[..., None] * w_scale -> [..., N] out_dtype, accumulated in f32.

  x [..., K] (bf16, or e4m3 quantized per row with f32 `x_scale` [...]); w [N, K] (bf16, or e4m3
  with f32 `w_scale` [N]); bf16 weights may also be stored [K, N] (`w_layout="kn"`, computing
  x @ w). A missing scale is 1. Any number of rows (padded to the tile inside)."""
  _validate(x, w, x_scale, w_scale, out_dtype, w_layout)
  n, k = w.shape if w_layout == "nk" else w.shape[::-1]
  ok, why = pallas_support(x.dtype, w.dtype, n, k, w_layout)
  arch = common.runnable_arch()
  if ok and arch is not None and arch not in _KERNELS:
    ok, why = False, f"no {arch} kernel yet"
  impl = common.resolve(implementation, supported=ok, why=why)
  lead = x.shape[:-1]
  x2 = x.reshape(-1, k)
  xs = None if x_scale is None else x_scale.reshape(-1).astype(jnp.float32)
  ws = None if w_scale is None else w_scale.astype(jnp.float32)
  if impl == "xla":
    w_nk = w if w_layout == "nk" else w.T
    return reference.gemm(x2, w_nk, xs, ws, out_dtype=out_dtype).reshape(*lead, n)
  m = x2.shape[0]
  if m == 0:
    return jnp.zeros((*lead, n), out_dtype)
  cfg = config or default_config(m, n, k, x.dtype, w_layout)
  check(cfg.w_kn == (w_layout == "kn"), f"gemm: config.w_kn={cfg.w_kn} but w_layout={w_layout!r}")
  if arch == "sm100":
    cfg = sm100.config_for(cfg)
  m_pad = -(-m // cfg.cta_m) * cfg.cta_m
  if (xs is None) != (ws is None):  # the kernel's epilogue takes both or neither
    xs = jnp.ones((m,), jnp.float32) if xs is None else xs
    ws = jnp.ones((n,), jnp.float32) if ws is None else ws
  if m_pad != m:
    x2 = jnp.pad(x2, ((0, m_pad - m), (0, 0)))
    xs = None if xs is None else jnp.pad(xs, (0, m_pad - m))
  out = _KERNELS[arch](x2, w, xs, ws, cfg=cfg, out_dtype=out_dtype)
  if cfg.k_splits > 1:  # f32 partials: reduce, then the epilogue XLA fuses into the reduction
    out = out.sum(0)
    if xs is not None:
      out = out * xs[:, None] * ws[None, :]
    out = out.astype(out_dtype)
  return out[:m].reshape(*lead, n)
