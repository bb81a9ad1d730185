"""Decode / verify attention's resource planner: the only place that decides whether the Pallas
kernel takes a call and with how many K/V pipeline stages (see pallas_kernels/resources.py).

Per CTA: the packed query tile, a `stages`-deep ring of K and V tiles (plus their scales and bf16
conversion buffers for an FP8 cache), per-row positions / chunk starts / tree bit words, the
partial output, log-sum-exp and P tiles of each compute warpgroup, and on sm_100 the S and O
accumulators in TMEM; on a paged cache, the split's tile ids. The stage count starts at the architecture's `smem_plan` (its SMEM budget)
and drops (by whole multiples of the compute warpgroups) until everything fits.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import common, resources
from pallas_kernels.decode_attention import sm90, sm100

OP = "decode_attention"
SUPPORTED_HEAD_DIMS = (64, 128)
BLOCK_KV = 64
COMPUTE_WGS = 2
# The CPU interpreter runs each warpgroup as a thread blocked in XLA callbacks; see api.py.
INTERPRET_COMPUTE_WGS = 1
MAX_TREE = 128  # tree visibility travels as 4 int32 bit words per query row
# Paged cache (pools [N, block_size, K, Dh] + block table [B, M]): the kernel's KV tile stays
# BLOCK_KV = 64 slots and block_size must be a multiple of it, so a tile never straddles two
# blocks: one TMA box per tile from pool tile block * (block_size / 64) + offset, the same copy
# (and the same 64-row wgmma / tcgen05 tiling, SMEM ring and masks) as the contiguous kernel.
# The alternative, tile = block, would tie the MMA shape and the SMEM ring to the serving
# block size (a 16-slot block would mean 16-row MMAs); smaller blocks than 64 would need several
# TMA copies per tile. Each CTA keeps its split's tile ids in SMEM, at most MAX_SPLIT_TILES
# (4 KiB; 64K slots); longer contexts take more splits.
MAX_SPLIT_TILES = 1024
FP8 = jnp.dtype(jnp.float8_e4m3fn)
BF16 = jnp.dtype(jnp.bfloat16)


@dataclasses.dataclass(frozen=True)
class Config:
  stages: int  # K/V ring slots (a multiple of compute_wgs)
  compute_wgs: int
  block_m: int  # packed (query, head) rows per CTA: the MMA M
  block_kv: int = BLOCK_KV


def usage(cfg: Config, arch: str, Dh: int, kv_dtype, tree_words: int,
          split_tiles: int = 0) -> resources.Usage:
  """What sm90/sm100.split_attention allocates, buffer by buffer."""
  fp8 = jnp.dtype(kv_dtype) == FP8
  C, M, bkv, st = cfg.compute_wgs, cfg.block_m, cfg.block_kv, cfg.stages
  f32 = jnp.float32
  u = resources.Usage().reduction_scratch()  # the softmax's row max and sum
  u.smem("q tile", (M, Dh), BF16)
  u.smem("K stages", (st, bkv, Dh), kv_dtype)
  u.smem("V stages", (st, bkv, Dh), kv_dtype)
  if fp8:
    u.smem("bf16 conversion", (C, bkv, Dh), BF16)
    u.smem("K scales", (st, bkv), f32)
    u.smem("V scales", (st, bkv), f32)
  u.smem("positions", (M,), jnp.int32)
  u.smem("chunk starts", (M,), jnp.int32)
  if tree_words:
    u.smem("tree bits", (tree_words, M), jnp.int32)
  u.smem("bounds", (sm90.NUM_BOUNDS,), jnp.int32)
  if split_tiles:
    u.smem("tile ids", (split_tiles,), jnp.int32)
  if arch == "sm90":
    u.smem("partial outputs", (C, M, Dh), BF16)
  u.smem("lse", (C, M), f32)
  u.smem("P tiles", (C, M, bkv), BF16)
  if arch == "sm100":
    u.tmem(C * bkv)  # S
    u.tmem(C * Dh)  # O
  u.barrier(1 + 2 * st + (2 * st if fp8 else 0) + 2 * st + (C if arch == "sm100" else 0))
  return u


def plan(T: int, num_heads: int, num_kv_heads: int, head_dim: int, cache_len: int, kv_dtype,
         q_dtype=jnp.bfloat16, *, tree_size: int | None = None, arch: str | None = None,
         interpreting: bool | None = None, compute_wgs: int | None = None,
         block_size: int | None = None) -> resources.Plan:
  """T new queries per row (num_heads heads over num_kv_heads kv heads) against a cache of
  cache_len slots; tree_size: the tree block's slots (None: no tree); block_size: a paged
  cache's (cache_len = table entries x block_size; None: contiguous). compute_wgs: default 2 (1
  in interpret mode)."""
  arch = resources.plan_arch(arch)
  no = lambda why: resources.Plan.unsupported(OP, arch, why)
  why = []
  if jnp.dtype(q_dtype) != BF16:
    why.append(f"q dtype {jnp.dtype(q_dtype)} (the kernel takes bfloat16)")
  if jnp.dtype(kv_dtype) not in (BF16, FP8):
    why.append(f"cache dtype {jnp.dtype(kv_dtype)} (bfloat16 or float8_e4m3fn)")
  if head_dim not in SUPPORTED_HEAD_DIMS:
    why.append(f"head_dim {head_dim} (supported: {SUPPORTED_HEAD_DIMS})")
  if cache_len % BLOCK_KV:
    why.append(f"cache length {cache_len} is not a multiple of {BLOCK_KV}")
  if block_size is not None and block_size % BLOCK_KV:
    why.append(f"paged block size {block_size} is not a multiple of the {BLOCK_KV}-slot KV tile")
  if tree_size is not None and tree_size > MAX_TREE:
    why.append(f"tree of {tree_size} slots (at most {MAX_TREE})")
  if num_kv_heads <= 0 or num_heads % num_kv_heads:
    why.append(f"{num_heads} query heads over {num_kv_heads} kv heads: not whole GQA groups")
  if why:
    return no("; ".join(why))
  if interpreting is None:
    interpreting = common.interpreting()
  C = compute_wgs or (INTERPRET_COMPUTE_WGS if interpreting else COMPUTE_WGS)
  kernel = sm90 if arch == "sm90" else sm100
  itemsize = jnp.dtype(kv_dtype).itemsize
  tree_words = 0 if tree_size is None else -(-tree_size // 32)
  last = None
  for stages in range(kernel.smem_plan(head_dim, BLOCK_KV, itemsize, C), 0, -C):
    cfg = Config(stages, C, kernel.BLOCK_M)
    split_tiles = 0
    if block_size is not None:  # the largest split table (padded as api._split_tiles does)
      n = min(cache_len // BLOCK_KV, MAX_SPLIT_TILES)
      split_tiles = -(-n // 4) * 4 if n <= 128 else -(-n // 128) * 128
    last = usage(cfg, arch, head_dim, kv_dtype, tree_words, split_tiles)
    if not last.over(arch):
      return resources.Plan.of(OP, arch, cfg, last)
  return resources.Plan.unsupported(OP, arch, f"no stage count fits: {last.over(arch)}", last)
