"""decode_attention: new queries (decode, EAGLE-3 verify, tree verify) over a KV cache.

Semantics (= maverick.model.attention(q, k, v, cache_mask(q_positions, S, chunk_size, tree),
k_scale, v_scale), see reference.py): slot s holds position s; query at position p sees slots
0 <= s <= p (and s // chunk_size == p // chunk_size on chunked layers); with a tree block, slots
tree_start .. tree_start+R-1 hold positions tree_positions and query t sees tree slot r iff
tree_visible[b, t, r] and the positional mask allows it; slots after the block are invisible.
A query that sees no slot returns 0 (the model never produces one).

decode_attention_paged: the same over a paged cache (pools + block table); the kernel reads each
KV tile from its block (see plan.py for the tile / block size choice), "xla" gathers first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.decode_attention import combine as combine_kernel
from pallas_kernels.decode_attention import plan as plan_lib
from pallas_kernels.decode_attention import reference
from pallas_kernels.quantize_rows import reference as quantize_reference

SUPPORTED_HEAD_DIMS = plan_lib.SUPPORTED_HEAD_DIMS
BLOCK_KV = plan_lib.BLOCK_KV
# Consumer warpgroups per CTA (plus one TMA producer). The CPU interpreter runs each warpgroup as
# a thread that blocks inside XLA callbacks; with 3 of them on a 2-core host XLA's CPU pool can
# starve and deadlock (seen ~1 run in 7), so interpret mode runs 1 consumer: the same code path
# with every KV step on warpgroup 0. GPU lowering is checked with 2.
COMPUTE_WGS = plan_lib.COMPUTE_WGS
INTERPRET_COMPUTE_WGS = plan_lib.INTERPRET_COMPUTE_WGS
MAX_TREE = plan_lib.MAX_TREE
FP8 = jnp.dtype(jnp.float8_e4m3fn)


def _shape(x) -> str:
  return f"shape {tuple(x.shape)} dtype {jnp.dtype(x.dtype).name}"


def _validate(q, k_cache, v_cache, q_positions, chunk_size, k_scale, v_scale, tree_start,
              tree_positions, tree_visible, num_splits):
  check = common.check
  check(q.ndim == 4, f"q: got {_shape(q)}; expected [B, T, H, Dh]")
  B, T, H, Dh = q.shape
  check(jnp.dtype(q.dtype) == jnp.bfloat16, f"q: got {_shape(q)}; pass bfloat16 queries")
  check(k_cache.ndim == 4 and k_cache.shape[0] == B and k_cache.shape[3] == Dh,
        f"k_cache: got {_shape(k_cache)}; expected [B={B}, S, K, Dh={Dh}] matching q")
  S, K = k_cache.shape[1], k_cache.shape[2]
  check(v_cache.shape == k_cache.shape,
        f"v_cache: got {_shape(v_cache)}; expected the shape of k_cache {tuple(k_cache.shape)}")
  check(K > 0 and H % K == 0, f"q: {H} heads is not a multiple of k_cache's {K} kv heads")
  kv_dtype = jnp.dtype(k_cache.dtype)
  check(kv_dtype in (jnp.dtype(jnp.bfloat16), FP8),
        f"k_cache: got {_shape(k_cache)}; the cache must be bfloat16 or float8_e4m3fn")
  check(jnp.dtype(v_cache.dtype) == kv_dtype,
        f"v_cache: got {_shape(v_cache)}; must have k_cache's dtype {kv_dtype.name}")
  check(q_positions.shape == (B, T) and jnp.issubdtype(q_positions.dtype, jnp.integer),
        f"q_positions: got {_shape(q_positions)}; expected int32 [B={B}, T={T}]")
  if kv_dtype == FP8:
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
      check(s is not None, f"{name}: missing; an FP8 cache needs float32 scales [B={B}, S={S}, "
            f"K={K}]")
      check(s.shape == (B, S, K) and jnp.dtype(s.dtype) == jnp.float32,
            f"{name}: got {_shape(s)}; expected float32 [B={B}, S={S}, K={K}]")
  else:
    check(k_scale is None and v_scale is None,
          "k_scale/v_scale: given for a bfloat16 cache; scales go with a float8_e4m3fn cache only")
  check(chunk_size is None or (isinstance(chunk_size, int) and chunk_size > 0),
        f"chunk_size: got {chunk_size!r}; pass a positive int or None")
  check(num_splits is None or (isinstance(num_splits, int) and num_splits > 0),
        f"num_splits: got {num_splits!r}; pass a positive int or None (auto)")
  tree = (tree_start, tree_positions, tree_visible)
  check(all(t is None for t in tree) or all(t is not None for t in tree),
        "tree_start/tree_positions/tree_visible: pass all three or none")
  if tree_start is not None:
    check(tree_start.shape == (B,), f"tree_start: got {_shape(tree_start)}; expected int [B={B}]")
    check(tree_positions.ndim == 2 and tree_positions.shape[0] == B,
          f"tree_positions: got {_shape(tree_positions)}; expected int [B={B}, R]")
    R = tree_positions.shape[1]
    check(tree_visible.shape == (B, T, R) and jnp.dtype(tree_visible.dtype) == jnp.bool_,
          f"tree_visible: got {_shape(tree_visible)}; expected bool [B={B}, T={T}, R={R}]")


def _validate_quantize(quantize, tokens):
  if quantize is None:
    return
  check = common.check
  check(isinstance(quantize, tuple) and len(quantize) == 2,
        f"quantize: got {quantize!r}; pass (rows_out, ub) or None")
  rows_out, ub = quantize
  check(isinstance(rows_out, int) and rows_out >= tokens,
        f"quantize: rows_out={rows_out!r} is fewer than the B*T={tokens} token rows")
  check(ub is None or ub > 0, f"quantize: ub={ub!r}; pass a positive cap or None")


def _quantize_kw(quantize):
  """_pallas's quantize keyword: none without quantize (the call stays as it was), else a
  hashable jit key (int, float or None), so ub 1200 and 1200.0 share a compile."""
  if quantize is None:
    return {}
  return {"quantize": (int(quantize[0]), None if quantize[1] is None else float(quantize[1]))}


def _quantize_xla(y, quantize):
  """(y, q, s): y's token rows [B*T, H*Dh] quantized as quantize_rows does (the fallback)."""
  if quantize is None:
    return y
  B, T, H, Dh = y.shape
  q, s = quantize_reference.quantize_rows(y.reshape(B * T, H * Dh), quantize[0], quantize[1])
  return y, q, s


def _kernel_module(arch: str):
  """The split-K kernel for `arch`: sm90 (wgmma, 64-row tiles) or sm100 (tcgen05, 128 rows)."""
  if arch == "sm100":
    from pallas_kernels.decode_attention import sm100 as kernel
  else:
    from pallas_kernels.decode_attention import sm90 as kernel
  return kernel


def packed_rows(steps: int, heads: int, kv_heads: int, arch: str | None = None) -> int:
  """Mpad: the packed query rows per (row, KV head) the kernel on `arch` (default the one a
  kernel would run on; Hopper's where none can) reads for `steps` tokens: T * G rounded up to
  its row tile. `q_packed` has this many."""
  block_m = _kernel_module(arch or common.runnable_arch() or "sm90").BLOCK_M
  return -(-steps * (heads // kv_heads) // block_m) * block_m


def _unpack(q_packed, q_shape):
  """[B*K, Mpad, Dh] packed queries -> q [B, T, H, Dh] (the XLA path's input)."""
  B, T, H, Dh = q_shape
  K = q_packed.shape[0] // B
  G = H // K
  return q_packed[:, :T * G].reshape(B, K, T, G, Dh).transpose(0, 2, 1, 3, 4).reshape(q_shape)


def _packed(q, q_packed, num_kv_heads):
  """(q as an array or its ShapeDtypeStruct, keyword arguments for _pallas) for a call given
  q_packed or not."""
  if q_packed is None:
    return q, {}
  B, T, H, Dh = q.shape
  mpad = packed_rows(T, H, num_kv_heads)
  common.check(q_packed.shape == (B * num_kv_heads, mpad, Dh)
               and jnp.dtype(q_packed.dtype) == jnp.bfloat16,
               f"q_packed: got {_shape(q_packed)}; expected bfloat16 [B*K={B * num_kv_heads}, "
               f"{mpad}, {Dh}] (qkv_finish with mpad=packed_rows(T, H, K))")
  return q_packed, {"q_shape": tuple(q.shape)}


def _pack_rows(x, G, Mpad, fill):
  """[B, T, ...] per-query values -> [B, Mpad, ...] per packed row m = t * G + g."""
  x = jnp.repeat(x, G, axis=1)
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, Mpad - x.shape[1])
  return jnp.pad(x, pad, constant_values=fill)


def default_num_splits(work_items: int, num_kv_blocks: int) -> int:
  """Enough splits to give every SM a CTA (one CTA fills an SM: ~200 KiB SMEM), at least one KV
  block each."""
  return max(1, min(common.num_sms() // max(work_items, 1), num_kv_blocks, 64))


# One jit over the packing, the kernel and the combine (eager jnp ops would each compile).
# mode = (interpreting, arch, consumer warpgroups, K/V stages) is static: interpreted and GPU executables never
# share a cache entry.
_STATIC = ("chunk_size", "num_splits", "sm_scale", "mode", "quantize", "q_shape")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _pallas(q, k_cache, v_cache, q_positions, chunk_size, k_scale, v_scale, tree_start,
            tree_positions, tree_visible, num_splits, sm_scale, mode, quantize=None,
            q_shape=None):
  return _run(q, k_cache, v_cache, q_positions, chunk_size, k_scale, v_scale, tree_start,
              tree_positions, tree_visible, num_splits, sm_scale, mode, None, quantize, q_shape)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _pallas_paged(q, k_pool, v_pool, block_table, q_positions, chunk_size, k_scale, v_scale,
                  tree_start, tree_positions, tree_visible, num_splits, sm_scale, mode,
                  quantize=None, q_shape=None):
  return _run(q, k_pool, v_pool, q_positions, chunk_size, k_scale, v_scale, tree_start,
              tree_positions, tree_visible, num_splits, sm_scale, mode, block_table, quantize,
              q_shape)


def _split_tiles(block_table, block_size, split_first, num_blocks, per_max):
  """[B, num_splits, R, W] int32: the pool tile (of BLOCK_KV slots; the pool reshaped to
  [N * block_size // BLOCK_KV, BLOCK_KV, ...]) that KV step i of each split reads, at [i // W,
  i % W]. Tile t of row b lives in block block_table[b, t // per_block]. NO_BLOCK (< 0) entries
  map to tile 0 so that every id is in range; the bounds never step onto them (they hold
  positions outside every query's mask), so tile 0 is not read for them. W (a multiple of 4,
  at most 128) and R keep the per-CTA TMA copy within the 16-byte / 256-element box rules."""
  per_block = block_size // BLOCK_KV
  t = jnp.arange(num_blocks, dtype=jnp.int32)
  blk = jnp.take(block_table.astype(jnp.int32), t // per_block, axis=1)  # [B, num_blocks]
  phys = jnp.where(blk >= 0, blk * per_block + t % per_block, 0)
  W = min(128, -(-per_max // 4) * 4)
  R = -(-per_max // W)
  i = jnp.arange(R * W, dtype=jnp.int32)
  logical = jnp.clip(split_first[:, :, None] + i, 0, num_blocks - 1)  # [B, splits, R*W]
  tiles = jnp.take_along_axis(phys[:, None, :], logical, axis=2)
  return tiles.reshape(tiles.shape[:2] + (R, W))


def _run(q, k_cache, v_cache, q_positions, chunk_size, k_scale, v_scale, tree_start,
         tree_positions, tree_visible, num_splits, sm_scale, mode, block_table, quantize=None,
         q_shape=None):
  """The kernel on a contiguous cache (block_table None) or on pools + block table; with
  `quantize`, (y, q, s). `q_shape`: q is already packed (see decode_attention's q_packed)."""
  kernel = _kernel_module(mode[1])
  B, T, H, Dh = q.shape if q_shape is None else q_shape
  K = k_cache.shape[2]
  if block_table is None:
    S = k_cache.shape[1]
  else:
    S = block_table.shape[1] * k_cache.shape[1]  # the logical cache: table entries x block
  G = H // K
  M = T * G
  Mpad = -(-M // kernel.BLOCK_M) * kernel.BLOCK_M
  num_m = Mpad // kernel.BLOCK_M
  num_blocks = S // BLOCK_KV
  if num_splits is None:
    num_splits = default_num_splits(B * K * num_m, num_blocks)
  if block_table is not None:  # a split's tile ids fit its SMEM table (plan.MAX_SPLIT_TILES)
    num_splits = max(num_splits, -(-num_blocks // plan_lib.MAX_SPLIT_TILES))
  num_splits = min(num_splits, num_blocks)

  q_positions = q_positions.astype(jnp.int32)
  if chunk_size is None:
    chunk_start = jnp.zeros_like(q_positions)
  else:
    chunk_start = (q_positions // chunk_size) * chunk_size
  if q_shape is None:
    q_packed = q.reshape(B, T, K, G, Dh).transpose(0, 2, 1, 3, 4).reshape(B * K, M, Dh)
    q_packed = jnp.pad(q_packed, ((0, 0), (0, Mpad - M), (0, 0)))
  else:
    q_packed = q
  pos_rows = _pack_rows(q_positions, G, Mpad, -1)  # padded rows see nothing
  cs_rows = _pack_rows(chunk_start, G, Mpad, 0)

  max_q = jnp.max(q_positions, axis=1)
  hi = jnp.clip(max_q + 1, 0, S)
  lo = jnp.min(chunk_start, axis=1)
  tree_bits = None
  if tree_start is None:
    t_start = t_end = jnp.full((B,), S, jnp.int32)
  else:
    R = tree_positions.shape[1]
    t_start = tree_start.astype(jnp.int32)
    t_end = t_start + R
    tp = tree_positions.astype(jnp.int32)[:, None, :]
    qp = q_positions[:, :, None]
    eff = tree_visible & (tp <= qp) & (tp >= 0)  # the positional mask, folded into the bits
    if chunk_size is not None:
      eff &= (tp // chunk_size) == (qp // chunk_size)
    words = -(-R // 32)
    eff = jnp.pad(eff, ((0, 0), (0, 0), (0, 32 * words - R))).reshape(B, T, words, 32)
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
    packed = jnp.sum(jnp.where(eff, weights, jnp.uint32(0)), axis=-1, dtype=jnp.uint32)
    packed = jax.lax.bitcast_convert_type(packed, jnp.int32)  # [B, T, W]
    tree_bits = _pack_rows(packed, G, Mpad, 0).transpose(0, 2, 1)  # [B, W, Mpad]
    hi = jnp.clip(jnp.maximum(jnp.minimum(max_q + 1, t_start), t_end), 0, S)
    lo = jnp.minimum(lo, t_start)
  lo = jnp.clip(lo, 0, hi)
  first = lo // BLOCK_KV
  n = jnp.maximum(-(-hi // BLOCK_KV) - first, 0)
  per = -(-n // num_splits)
  j = jnp.arange(num_splits, dtype=jnp.int32)[None, :]
  split_first = first[:, None] + j * per[:, None]
  split_steps = jnp.clip(n[:, None] - j * per[:, None], 0, per[:, None])
  bounds = jnp.stack([split_first, split_steps,
                      jnp.broadcast_to(t_start[:, None], split_first.shape),
                      jnp.broadcast_to(t_end[:, None], split_first.shape)], axis=-1)

  ks = vs = tiles = None
  if block_table is None:
    if k_scale is not None:
      # [B, K, S]: one TMA copy per tile reads a contiguous run of scales (~1.5% of fp8 bytes).
      ks = jnp.transpose(k_scale, (0, 2, 1))
      vs = jnp.transpose(v_scale, (0, 2, 1))
  else:
    bs = k_cache.shape[1]
    tiles = _split_tiles(block_table, bs, split_first, num_blocks, -(-num_blocks // num_splits))
    # Pools [N, bs, K, Dh] -> [N * bs/64, 64, K, Dh]: a free reshape, one TMA box per tile.
    as_tiles = lambda x: x.reshape((-1, BLOCK_KV) + x.shape[2:])
    k_cache, v_cache = as_tiles(k_cache), as_tiles(v_cache)
    if k_scale is not None:
      # [N * bs/64, K, 64] (a transpose of the whole scale pool, ~3% of the fp8 pool's bytes;
      # a pool stored kv-head-major would avoid it).
      ks = jnp.transpose(as_tiles(k_scale), (0, 2, 1))
      vs = jnp.transpose(as_tiles(v_scale), (0, 2, 1))
  out, lse = kernel.split_attention(
      q_packed, k_cache, v_cache, ks, vs, pos_rows, cs_rows, tree_bits, bounds.astype(jnp.int32),
      num_kv_heads=K, num_splits=num_splits, block_kv=BLOCK_KV, sm_scale=sm_scale,
      compute_wgs=mode[2], stages=mode[3], tile_table=tiles)
  if combine_kernel.supported_head_dim(Dh):  # one launch, where XLA's combine takes four
    if quantize is not None and combine_kernel.supports_quantize(H, Dh):
      # The O-proj's FP8 input from the same launch: no quantize kernel after it.
      return combine_kernel.combine_rows(out, lse, batch=B, steps=T, groups=G,
                                         out_dtype=q.dtype, quantize=quantize)
    y = combine_kernel.combine_rows(out, lse, batch=B, steps=T, groups=G, out_dtype=q.dtype)
    return _quantize_xla(y, quantize)
  out = combine(out.astype(jnp.float32), lse)  # [B*K, Mpad, Dh] f32
  out = out[:, :M].reshape(B, K, T, G, Dh).transpose(0, 2, 1, 3, 4).reshape(B, T, H, Dh)
  return _quantize_xla(out.astype(q.dtype), quantize)


def combine(out, lse):
  """Merges split partials: out [P, ..., Dh] (each normalised), lse [P, ...] (log2 units). The
  XLA form, kept for head dims the combine kernel (combine.py) does not take and as its
  reference.

  The weights' sum rides along as an extra column of ones, so one reduction gives both sums:
  three launches on a GPU (max, weights, sums), not four. (A variadic log-sum-exp reduce over
  the splits was tried: XLA materializes its broadcast operands, four launches again.)"""
  mx = jnp.max(lse, axis=0)
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  w = jnp.exp2(lse - mx)  # -inf (empty split) -> 0
  ones = jnp.ones(out.shape[:-1] + (1,), out.dtype)
  total = jnp.sum(w[..., None] * jnp.concatenate([out, ones], axis=-1), axis=0)
  num, den = total[..., :-1], total[..., -1]
  return jnp.where(den[..., None] > 0, num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def decode_attention(q, k_cache, v_cache, q_positions, *, chunk_size: int | None = None,
                     k_scale=None, v_scale=None, tree_start=None, tree_positions=None,
                     tree_visible=None, num_splits: int | None = None,
                     sm_scale: float | None = None, implementation: str | None = None,
                     quantize: tuple[int, float | None] | None = None, q_packed=None):
  """q [B,T,H,Dh] bf16; k_cache/v_cache [B,S,K,Dh] bf16 or float8_e4m3fn (then k_scale/v_scale
  [B,S,K] f32); q_positions [B,T] int. Optional chunk_size (chunked layers), tree block
  (tree_start [B], tree_positions [B,R], tree_visible [B,T,R] bool), num_splits (split-K; auto
  from the SM count, at most S // 64), sm_scale (default Dh**-0.5). Returns [B,T,H,Dh] bf16.
  The kernel takes head_dim 64/128, S % 64 == 0 and trees of at most 128 slots; otherwise None
  falls back to XLA and "pallas" raises KernelInputError. Kernels: sm90.py (Hopper, wgmma) and
  sm100.py (Blackwell, tcgen05/TMEM), picked by `common.target_arch()`.

  `quantize` (rows_out >= B*T, ub None or > 0): returns (y, q, s), q e4m3 [rows_out, H*Dh] and
  s f32 [rows_out] = quantize_rows.reference.quantize_rows(y.reshape(B*T, H*Dh), rows_out, ub):
  the O-projection's FP8 input, written by the combine kernel where it takes the token row
  (combine.supports_quantize), else quantized by XLA after it.

  `q_packed` [B*K, packed_rows(T, H, K), Dh] bf16: the queries already packed as the kernel reads
  them (`qkv_finish`'s output: kv head k of row b at [b*K + k], query head g at row t*G + g, the
  rest zero); `q` then gives only the shape (a ShapeDtypeStruct will do). Saves the pack launch."""
  _validate(q, k_cache, v_cache, q_positions, chunk_size, k_scale, v_scale, tree_start,
            tree_positions, tree_visible, num_splits)
  B, T, H, Dh = q.shape
  _validate_quantize(quantize, B * T)
  sm_scale = float(Dh ** -0.5 if sm_scale is None else sm_scale)
  interpreting = common.interpreting()
  plan = plan_lib.plan(
      T, H, k_cache.shape[2], Dh, k_cache.shape[1], k_cache.dtype, q.dtype,
      tree_size=None if tree_positions is None else tree_positions.shape[1],
      arch=common.runnable_arch(), interpreting=interpreting,
      compute_wgs=INTERPRET_COMPUTE_WGS if interpreting else COMPUTE_WGS)
  impl = common.resolve(implementation, supported=plan.supported, why=plan.why)
  q_arg, packed_kw = _packed(q, q_packed, k_cache.shape[2])
  if impl == "xla":
    q = q if q_packed is None else _unpack(q_packed, q.shape)
    return _quantize_xla(reference.decode_attention(
        q, k_cache, v_cache, q_positions, chunk_size=chunk_size, k_scale=k_scale,
        v_scale=v_scale, tree_start=tree_start, tree_positions=tree_positions,
        tree_visible=tree_visible, sm_scale=sm_scale), quantize)
  mode = (interpreting, common.target_arch(), plan.config.compute_wgs, plan.config.stages)
  return _pallas(q_arg, k_cache, v_cache, q_positions, chunk_size, k_scale, v_scale, tree_start,
                 tree_positions, tree_visible, num_splits, sm_scale, mode,
                 **_quantize_kw(quantize), **packed_kw)


def pallas_support(q, k_cache, tree_size: int | None = None, *, arch: str | None = None
                   ) -> tuple[bool, str]:
  """(supported, why not) for the Pallas kernel on q [B,T,H,Dh] over k_cache [B,S,K,Dh] (arrays or
  ShapeDtypeStructs) with a tree block of `tree_size` slots (None: no tree): the planner's answer,
  so a supported call lowers. `arch`: default the one a kernel would run on."""
  B, T, H, Dh = q.shape
  p = plan_lib.plan(T, H, k_cache.shape[2], Dh, k_cache.shape[1], k_cache.dtype, q.dtype,
                    tree_size=tree_size, arch=arch)
  return p.supported, p.why


def _validate_paged(k_pool, v_pool, block_table, k_scale, v_scale):
  check = common.check
  check(k_pool.ndim == 4, f"k_pool: got {_shape(k_pool)}; expected [num_blocks, block_size, K, Dh]")
  check(v_pool.shape == k_pool.shape,
        f"v_pool: got {_shape(v_pool)}; expected the shape of k_pool {tuple(k_pool.shape)}")
  check(block_table.ndim == 2 and jnp.issubdtype(block_table.dtype, jnp.integer),
        f"block_table: got {_shape(block_table)}; expected int32 [B, max_blocks_per_row]")
  for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
    check(s is None or s.shape == k_pool.shape[:3],
          f"{name}: got {_shape(s) if s is not None else None}; a paged FP8 cache takes scale "
          f"pools [num_blocks, block_size, K] = {tuple(k_pool.shape[:3])}")


def decode_attention_paged(q, k_pool, v_pool, block_table, q_positions, *,
                           chunk_size: int | None = None, k_scale=None, v_scale=None,
                           tree_start=None, tree_positions=None, tree_visible=None,
                           num_splits: int | None = None, sm_scale: float | None = None,
                           implementation: str | None = None,
                           quantize: tuple[int, float | None] | None = None, q_packed=None):
  """decode_attention over a paged cache: k_pool/v_pool [N, bs, K, Dh] (FP8: k_scale/v_scale
  [N, bs, K]) and block_table [B, M] int32: slot s of row b (position s, as in the contiguous
  cache of M * bs slots) is pool[block_table[b, s // bs], s % bs]; entries < 0 hold no block
  and must lie outside every query's mask. The kernel reads each 64-slot KV tile straight from
  its block (bs must be a multiple of 64; see plan.py), never materialising the contiguous
  view; "xla" gathers that view (reference.gather_pages) and runs the reference. `quantize`:
  as decode_attention's, returns (y, q, s); `q_packed` as decode_attention's."""
  _validate_paged(k_pool, v_pool, block_table, k_scale, v_scale)
  B = q.shape[0]
  common.check(block_table.shape[0] == B,
               f"block_table: got {_shape(block_table)}; expected [B={B}, M] matching q")
  view = jax.ShapeDtypeStruct((B, block_table.shape[1] * k_pool.shape[1]) + k_pool.shape[2:],
                              k_pool.dtype)
  scale_view = None if k_scale is None else jax.ShapeDtypeStruct(view.shape[:3], k_scale.dtype)
  _validate(q, view, view, q_positions, chunk_size, scale_view, scale_view, tree_start,
            tree_positions, tree_visible, num_splits)
  _validate_quantize(quantize, B * q.shape[1])
  Dh = q.shape[3]
  sm_scale = float(Dh ** -0.5 if sm_scale is None else sm_scale)
  interpreting = common.interpreting()
  plan = plan_lib.plan(
      q.shape[1], q.shape[2], k_pool.shape[2], Dh, view.shape[1], k_pool.dtype, q.dtype,
      tree_size=None if tree_positions is None else tree_positions.shape[1],
      arch=common.runnable_arch(), interpreting=interpreting,
      compute_wgs=INTERPRET_COMPUTE_WGS if interpreting else COMPUTE_WGS,
      block_size=k_pool.shape[1])
  impl = common.resolve(implementation, supported=plan.supported, why=plan.why)
  q_arg, packed_kw = _packed(q, q_packed, k_pool.shape[2])
  if impl == "xla":
    q = q if q_packed is None else _unpack(q_packed, q.shape)
    gather = lambda x: None if x is None else reference.gather_pages(x, block_table)
    return _quantize_xla(reference.decode_attention(
        q, gather(k_pool), gather(v_pool), q_positions, chunk_size=chunk_size,
        k_scale=gather(k_scale), v_scale=gather(v_scale), tree_start=tree_start,
        tree_positions=tree_positions, tree_visible=tree_visible, sm_scale=sm_scale), quantize)
  mode = (interpreting, common.target_arch(), plan.config.compute_wgs, plan.config.stages)
  return _pallas_paged(q_arg, k_pool, v_pool, block_table.astype(jnp.int32), q_positions,
                       chunk_size, k_scale, v_scale, tree_start, tree_positions, tree_visible,
                       num_splits, sm_scale, mode, **_quantize_kw(quantize), **packed_kw)


def pallas_support_paged(q, k_pool, block_table, tree_size: int | None = None, *,
                         arch: str | None = None) -> tuple[bool, str]:
  """pallas_support for decode_attention_paged (arrays or ShapeDtypeStructs)."""
  B, T, H, Dh = q.shape
  p = plan_lib.plan(T, H, k_pool.shape[2], Dh, block_table.shape[1] * k_pool.shape[1],
                    k_pool.dtype, q.dtype, tree_size=tree_size, arch=arch,
                    block_size=k_pool.shape[1])
  return p.supported, p.why
