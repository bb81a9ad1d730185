"""Hopper (sm_90) GEMM: out[M, N] = (x[M, K] @ w[N, K].T) * x_scale[:, None] * w_scale[None, :].

One kernel family for bf16 x bf16 and e4m3 x e4m3 (f32 accumulation either way). Several
weights may share one x (`gemm_many`: q, k and v, or gate and up): their N tiles are one work
list, each product goes to its own output, and the decode step spends one launch on them.

  grid: one CTA per SM, persistent over (m tile, n tile, k split) work items;
  warpgroups: 2 compute WGs (wgmma) + 1 memory WG issuing TMA (warp specialization);
  pipeline: `stages` K steps in flight, x and w tiles TMA-loaded into swizzled SMEM;
  epilogue: row and column scales multiply the f32 accumulator in registers, then the output tile
    goes out through SMEM by TMA (bf16), or, with a K split, the raw f32 partial does and the
    caller reduces the splits and scales (split-K gives decode shapes enough CTAs to saturate HBM).

FP8 wgmma takes only K-major operands, which is why weights are stored (N, K): the w tile is fed
transposed (`w_smem.T`), a free view. The two compute WGs split the CTA tile along N (decode: M is
one tile) or M (prefill).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common

NUM_COMPUTE_WGS = 2


@dataclasses.dataclass(frozen=True)
class Config:
  tile_m: int  # rows per compute WG (wgmma M: a multiple of 64)
  tile_n: int  # columns per compute WG
  tile_k: int
  stages: int  # K steps in flight
  wg_split: str  # "n": the 2 compute WGs split the CTA tile along N; "m": along M
  k_splits: int = 1
  w_kn: bool = False  # w stored (K, N) (16-bit only: wgmma transposes 16-bit B tiles, not FP8)

  @property
  def cta_m(self) -> int:
    return self.tile_m * (NUM_COMPUTE_WGS if self.wg_split == "m" else 1)

  @property
  def cta_n(self) -> int:
    return self.tile_n * (NUM_COMPUTE_WGS if self.wg_split == "n" else 1)


def _transforms(tile_minor: int, dtype) -> tuple:
  swizzle = plgpu.find_swizzle(tile_minor * jnp.dtype(dtype).itemsize * 8)
  elems = swizzle // jnp.dtype(dtype).itemsize
  return plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle)


def _n_of(w, cfg: Config) -> int:
  return w.shape[1] if cfg.w_kn else w.shape[0]


def _body(x_gmem, *refs, cfg: Config, out_dtype, num_w: int):
  """refs: w_0..w_{r-1}, xs, ws_0..ws_{r-1}, out_0..out_{r-1} (r = num_w)."""
  common.pdl_prologue()
  w_refs, xs_gmem = refs[:num_w], refs[num_w]
  w_scales, outs = refs[num_w + 1:2 * num_w + 1], refs[2 * num_w + 1:]
  m_pad, k = x_gmem.shape
  w_gmem = w_refs[0]
  m_tiles = m_pad // cfg.cta_m
  tiles_of = [_n_of(w, cfg) // cfg.cta_n for w in w_refs]
  first_tile = [sum(tiles_of[:i]) for i in range(num_w)]
  n_tiles = sum(tiles_of)
  k_steps = k // cfg.tile_k // cfg.k_splits
  in_tf = _transforms(cfg.tile_k, x_gmem.dtype)
  out_tf = _transforms(cfg.tile_n, out_dtype)
  w_tf = _transforms(cfg.tile_n, w_gmem.dtype) if cfg.w_kn else in_tf
  split_m = cfg.wg_split == "m"

  def pipeline(step_fn, context):
    return plgpu.emit_pipeline_warp_specialized(
        step_fn,
        grid=(k_steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((cfg.cta_m, cfg.tile_k), lambda kk: (0, kk), transforms=in_tf),
            plgpu.BlockSpec((cfg.tile_k, cfg.cta_n), lambda kk: (kk, 0), transforms=w_tf)
            if cfg.w_kn else
            plgpu.BlockSpec((cfg.cta_n, cfg.tile_k), lambda kk: (0, kk), transforms=in_tf),
        ],
        wg_axis="wg",
        num_compute_wgs=NUM_COMPUTE_WGS,
        max_concurrent_steps=cfg.stages,
        compute_context=context,
    )

  unused = lambda *_, **__: None
  scope = dict(
      pipeline_allocs=pipeline(unused, unused).get_allocations(x_gmem, w_gmem),
      out_smem=plgpu.SMEM((NUM_COMPUTE_WGS, cfg.tile_m, cfg.tile_n), out_dtype, transforms=out_tf),
      row_scale_smem=plgpu.SMEM((NUM_COMPUTE_WGS, cfg.tile_m), jnp.float32),
      col_scale_smem=plgpu.SMEM((NUM_COMPUTE_WGS, cfg.tile_n), jnp.float32),
      scale_barriers=plgpu.Barrier(num_barriers=2 * NUM_COMPUTE_WGS),
  )

  @functools.partial(pl.run_scoped, **scope, collective_axes="wg")
  def _scoped(pipeline_allocs, out_smem, row_scale_smem, col_scale_smem, scale_barriers):
    wg = lax.axis_index("wg")

    def _tile(m_idx, n_idx, split, w_gmem, ws_gmem, out_gmem):
      wg_rows = pl.ds(wg * cfg.tile_m, cfg.tile_m) if split_m else slice(None)
      wg_cols = slice(None) if split_m else pl.ds(wg * cfg.tile_n, cfg.tile_n)
      row0 = m_idx * cfg.cta_m + (wg * cfg.tile_m if split_m else 0)
      col0 = n_idx * cfg.cta_n + (0 if split_m else wg * cfg.tile_n)
      rows, cols = pl.ds(row0, cfg.tile_m), pl.ds(col0, cfg.tile_n)

      def mma_step(_, x_smem, w_smem, acc_ref):
        w_tile = w_smem.at[:, wg_cols] if cfg.w_kn else w_smem.at[wg_cols].T
        plgpu.wgmma(acc_ref, x_smem.at[wg_rows], w_tile)
        plgpu.wgmma_wait(0)
        return acc_ref

      def context(run_pipeline):
        scaled = xs_gmem is not None
        if scaled:  # fetched under the main loop
          plgpu.copy_gmem_to_smem(xs_gmem.at[rows], row_scale_smem.at[wg],
                                  scale_barriers.at[2 * wg])
          plgpu.copy_gmem_to_smem(ws_gmem.at[cols], col_scale_smem.at[wg],
                                  scale_barriers.at[2 * wg + 1])

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((cfg.tile_m, cfg.tile_n), jnp.float32))
        def _acc_scope(acc_ref):
          run_pipeline(acc_ref)
          acc = acc_ref[...]
          if scaled:
            plgpu.barrier_wait(scale_barriers.at[2 * wg])
            plgpu.barrier_wait(scale_barriers.at[2 * wg + 1])
            shape = (cfg.tile_m, cfg.tile_n)
            acc = (acc * lax.broadcast_in_dim(row_scale_smem[wg], shape, (0,))
                   * lax.broadcast_in_dim(col_scale_smem[wg], shape, (1,)))
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile left out_smem
          out_smem[wg] = acc.astype(out_dtype)
          plgpu.commit_smem()
          dst = out_gmem.at[split] if cfg.k_splits > 1 else out_gmem
          plgpu.copy_smem_to_gmem(out_smem.at[wg], dst.at[rows, cols])

      k_range = pl.ds(split * k_steps * cfg.tile_k, k_steps * cfg.tile_k)
      pipeline(mma_step, context)(
          x_gmem.at[pl.ds(m_idx * cfg.cta_m, cfg.cta_m), k_range],
          (w_gmem.at[k_range, pl.ds(n_idx * cfg.cta_n, cfg.cta_n)] if cfg.w_kn
           else w_gmem.at[pl.ds(n_idx * cfg.cta_n, cfg.cta_n), k_range]),
          allocations=pipeline_allocs)

    @plgpu.nd_loop((m_tiles * n_tiles * cfg.k_splits,), collective_axes="sm")
    def _work_item(info: plgpu.NDLoopInfo):
      (linear,) = info.index
      tile, split = linear // cfg.k_splits, linear % cfg.k_splits
      # Consecutive work items share a w panel across m tiles (prefill) for L2 reuse.
      m_idx, n_all = tile % m_tiles, tile // m_tiles
      if num_w == 1:
        _tile(m_idx, n_all, split, w_refs[0], w_scales[0], outs[0])
        return
      for i in range(num_w):  # the weight this N tile belongs to
        @pl.when((n_all >= first_tile[i]) & (n_all < first_tile[i] + tiles_of[i]))
        def _(i=i):
          _tile(m_idx, n_all - first_tile[i], split, w_refs[i], w_scales[i], outs[i])

  plgpu.wait_smem_to_gmem(0)


def gemm(x, w, x_scale, w_scale, *, cfg: Config, out_dtype) -> jax.Array:
  """x [M_pad, K] (M_pad a multiple of cfg.cta_m), w [N, K] (or [K, N] with cfg.w_kn); scales f32 [M_pad], [N] or both None.
  Returns [M_pad, N] out_dtype, or f32 partials [k_splits, M_pad, N] (unscaled) when k_splits > 1."""
  return gemm_many(x, (w,), x_scale, None if w_scale is None else (w_scale,), cfg=cfg,
                   out_dtype=out_dtype)[0]


def out_types(m_pad: int, ns, cfg: Config, out_dtype):
  """The kernel's outputs for weights of N = ns: [M_pad, N] out_dtype each, or with a K split
  the f32 partials [k_splits, M_pad, N]."""
  if cfg.k_splits > 1:
    return tuple(jax.ShapeDtypeStruct((cfg.k_splits, m_pad, n), jnp.float32) for n in ns)
  return tuple(jax.ShapeDtypeStruct((m_pad, n), out_dtype) for n in ns)


def gemm_many(x, ws, x_scale, w_scales, *, cfg: Config, out_dtype,
              scale_partials: bool = False) -> tuple[jax.Array, ...]:
  """`gemm` of one x with each weight of `ws` (every N a multiple of cfg.cta_n), in one launch:
  a tuple of outputs; `w_scales` a tuple like `ws` (with x_scale), or None. With a K split the
  outputs are f32 partials [k_splits, M_pad, N]: unscaled, or with `scale_partials` each scaled
  in the epilogue (their sum is then the finished product, for a consumer that sums them)."""
  m_pad, _ = x.shape
  out_type = out_types(m_pad, [_n_of(w, cfg) for w in ws], cfg, out_dtype)
  if cfg.k_splits > 1:  # f32 partials, the scales applied to each (a linear map) or after
    out_dtype = jnp.float32
    if not scale_partials:
      x_scale, w_scales = None, None
  body = functools.partial(_body, cfg=cfg, out_dtype=out_dtype, num_w=len(ws))
  kernel = plgpu.kernel(
      body,
      out_type=out_type,
      grid=(common.num_sms(),),
      grid_names=("sm",),
      num_threads=NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  if x_scale is None:
    return kernel(x, *ws, None, *([None] * len(ws)))
  return kernel(x, *ws, x_scale, *w_scales)
