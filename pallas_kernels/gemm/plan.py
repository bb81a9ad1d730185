"""The GEMM's resource planner: the only place that decides whether the Pallas GEMM takes a call
and with which tiles, pipeline depth and K split (see pallas_kernels/resources.py).

Preference order, first fit wins:
  1. the tiles of `_tiles` with the deepest pipeline (4 stages for 64-row tiles, 3 for 128) and
     enough K splits to give every SM work (decode and short prefill: the weight stream is the
     cost). A K split stages an f32 partial tile in SMEM instead of the bf16 output tile, which
     at 128-row tiles leaves room for only 2 stages on sm_90: so next
  2. 64-row tiles (half the f32 tile, 4 stages), then 3 stages, then 2, each with its own splits;
  3. the same list with fewer K splits, down to none.
Nothing fits: unsupported, with the bytes that were needed.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_kernels import resources
from pallas_kernels.gemm import sm90, sm100

FP8 = jnp.dtype(jnp.float8_e4m3fn)
BF16 = jnp.dtype(jnp.bfloat16)
F32 = jnp.dtype(jnp.float32)
_SUPPORTED = ((BF16, BF16), (FP8, FP8))
# A K step is one swizzle row of 128 bytes, or 64/32 for narrow K (32 bytes = one wgmma K step).
TILE_K_BYTES = (128, 64, 32)
OP = "gemm"


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


def _splits(cfg: sm90.Config, m: int, n: int, k: int, num_sms: int) -> int:
  """K splits (a power of two) until every SM has a work item, each split keeping at least
  `stages` K steps."""
  k_steps = k // cfg.tile_k
  tiles = math.ceil(m / cfg.cta_m) * (n // cfg.cta_n)
  splits = 1
  while (tiles * splits < num_sms and k_steps % (2 * splits) == 0
         and k_steps // (2 * splits) >= cfg.stages):
    splits *= 2
  return splits


def usage(cfg: sm90.Config, arch: str, in_dtype, out_dtype) -> resources.Usage:
  """What the kernel allocates for `cfg` (sm100: a `sm100.config_for` config), mirroring
  sm90.gemm / sm100.gemm buffer by buffer."""
  out = F32 if cfg.k_splits > 1 else jnp.dtype(out_dtype)
  u = resources.Usage()
  if arch == "sm90":
    wgs = sm90.NUM_COMPUTE_WGS
    u.smem("x stages", (cfg.stages, cfg.cta_m, cfg.tile_k), in_dtype)
    u.smem("w stages", (cfg.stages, cfg.cta_n, cfg.tile_k), in_dtype)
    u.barrier(2 * cfg.stages)  # the warp-specialized pipeline: slot full / slot free
    u.smem("output tiles", (wgs, cfg.tile_m, cfg.tile_n), out)
    u.smem("row scales", (wgs, cfg.tile_m), F32)
    u.smem("column scales", (wgs, cfg.tile_n), F32)
    u.barrier(2 * wgs)
  else:
    tm, tn = sm100.TILE_M, cfg.tile_n
    u.smem("x stages", (cfg.stages, tm, cfg.tile_k), in_dtype)
    u.smem("w stages", (cfg.stages, tn, cfg.tile_k), in_dtype)
    u.tmem(2 * tn)  # double-buffered f32 accumulator
    u.smem("output pieces", (2, tm, sm100.epilogue_n(tn)), out)
    u.smem("row scales", (tm,), F32)
    u.smem("column scales", (tn,), F32)
    u.barrier(2 * cfg.stages + 6)
  return u


def _candidates(tiles):
  """(tile_m, stages) in preference order (see the module doc)."""
  tile_m = tiles[0]
  deep = 4 if tile_m == 64 else 3
  out = [(tile_m, s) for s in range(deep, 2, -1)]
  if tile_m == 128:
    out += [(64, 4), (64, 3)]
  out += [(tile_m, 2)] + ([(64, 2)] if tile_m == 128 else [])
  return out


def plan(m: int, n: int, k: int, x_dtype, w_dtype, *, w_layout: str = "nk",
         out_dtype=jnp.bfloat16, arch: str | None = None,
         num_sms: int | None = None) -> resources.Plan:
  """The GEMM x[m, k] @ w.T -> [m, n] on `arch` (default: the one a kernel would run on):
  `config` is an sm90.Config (on sm100 already passed through `sm100.config_for`)."""
  arch = resources.plan_arch(arch)
  pair = (jnp.dtype(x_dtype), jnp.dtype(w_dtype))
  no = lambda why: resources.Plan.unsupported(OP, arch, why)
  if pair not in _SUPPORTED:
    return no(f"dtypes x {pair[0]}, w {pair[1]}: the kernel takes bf16 x bf16 or e4m3 x e4m3 "
              f"(quantize x per token for FP8 weights)")
  if w_layout not in ("nk", "kn"):
    return no(f"w_layout={w_layout!r}; use 'nk' (K-major) or 'kn'")
  if w_layout == "kn" and pair[1].itemsize == 1:
    return no("FP8 tensor cores take only K-major weights: store the FP8 weight as (N, K) and "
              "pass w_layout='nk'")
  min_k = TILE_K_BYTES[-1] // pair[0].itemsize
  if k % min_k:
    return no(f"K={k} must be a multiple of {min_k} (32 bytes of {pair[0]})")
  if n % 16:
    return no(f"N={n} must be a multiple of 16")
  kn = w_layout == "kn"
  tiles = _tiles(max(m, 1), n, k, pair[0], kn)
  if tiles is None:
    return no(f"N={n}, K={k} with w stored (K, N): K must be a multiple of the N tile (16..64 "
              f"elements) that divides N")
  num_sms = num_sms or resources.plan_num_sms(arch)
  _, tile_n, tile_k, split = tiles
  candidates = []
  for tile_m, stages in _candidates(tiles):
    cfg = sm90.Config(tile_m, tile_n, tile_k, stages, split, w_kn=kn)
    candidates.append(dataclasses.replace(cfg, k_splits=_splits(cfg, m, n, k, num_sms)))
  fewer = []
  for cfg in candidates:
    s = cfg.k_splits // 2
    while s >= 1:
      fewer.append(dataclasses.replace(cfg, k_splits=s))
      s //= 2
  smallest = None
  for cfg in candidates + fewer:
    arch_cfg = sm100.config_for(cfg) if arch == "sm100" else cfg
    u = usage(arch_cfg, arch, pair[0], out_dtype)
    if not u.over(arch):
      return resources.Plan.of(OP, arch, arch_cfg, u)
    if smallest is None or u.smem_bytes < smallest.smem_bytes:
      smallest = u
  return resources.Plan.unsupported(
      OP, arch, f"no tile/stage/split-K config fits: the smallest {smallest.over(arch)}", smallest)


def check_config(cfg: sm90.Config, arch: str, in_dtype, out_dtype) -> resources.Plan:
  """A caller-given config (sm90 form) as it would run on `arch`, with `why` set if it does not
  fit."""
  arch_cfg = sm100.config_for(cfg) if arch == "sm100" else cfg
  return resources.Plan.of(OP, arch, arch_cfg, usage(arch_cfg, arch, in_dtype, out_dtype))


def plan_many(m: int, ns, k: int, x_dtype, w_dtype, *, w_layout: str = "nk",
              out_dtype=jnp.bfloat16, arch: str | None = None) -> resources.Plan:
  """One launch over several weights sharing x (`gemm_many`), of N = ns: the tiles of one N that
  divides them all (their gcd), the K split sized by the SMs the whole N list leaves idle."""
  arch = resources.plan_arch(arch)
  g, total = math.gcd(*ns), sum(ns)
  num_sms = max(1, resources.plan_num_sms(arch) * g // total)
  return plan(m, g, k, x_dtype, w_dtype, w_layout=w_layout, out_dtype=out_dtype, arch=arch,
              num_sms=num_sms)
