"""Blackwell (sm_100) GEMM: the sm90 contract (see sm90.py) on tcgen05 with the accumulator in TMEM.

  WG 0, warp 0 (producer): TMA-loads x and w tiles into a `stages`-deep ring of swizzled SMEM slots;
  WG 0, warp 1 (MMA): one thread issues tcgen05 MMAs; each MMA releases its slot to the producer
    through `consumed` when the tensor core is done reading it, and the last one of a tile signals
    `mma_done`;
  WG 1 (epilogue): TMEM -> registers, scales, SMEM, TMA store, in `epi_n`-column slices.
The TMEM accumulator is double buffered (2 x tile_n columns), so the epilogue of one tile overlaps
the MMAs of the next; `store_done` hands a buffer back to the MMA warp.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.gemm.sm90 import Config, _n_of, _transforms, out_types

TILE_M = 128  # one tcgen05 MMA covers 128 rows on one CTA
PRODUCER_WARP, MMA_WARP = 0, 1
MMA_WG, EPILOGUE_WG = 0, 1


def epilogue_n(tile_n: int) -> int:
  """Columns per epilogue piece (TMEM -> registers -> SMEM -> TMA)."""
  return min(64, tile_n)


def config_for(cfg: Config) -> Config:
  """sm100 tiles from the shared Config: 128-row tiles, no warpgroup split of the tile."""
  # A (K, N) weight tile's swizzle (along N) must match the x tile's (along K): keep sm90's pair.
  tile_n = cfg.tile_n if cfg.w_kn else min(cfg.cta_n, 256)
  return Config(TILE_M, tile_n, cfg.tile_k, cfg.stages, "n", cfg.k_splits, cfg.w_kn)


def _body(x_gmem, *refs, x_smem, w_smem, acc_tmem, out_smem, row_scale_smem, col_scale_smem,
          loaded, consumed, mma_done, store_done, scales_loaded, cfg: Config, out_dtype,
          epi_n: int, num_w: int):
  """refs: w_0..w_{r-1}, xs, ws_0..ws_{r-1}, out_0..out_{r-1} (r = num_w); then the scratch."""
  common.pdl_prologue()
  w_refs, xs_gmem = refs[:num_w], refs[num_w]
  w_scales, outs = refs[num_w + 1:2 * num_w + 1], refs[2 * num_w + 1:]
  m_pad, k = x_gmem.shape
  tm, tn, tk = TILE_M, cfg.tile_n, cfg.tile_k
  m_tiles = m_pad // tm
  tiles_of = [_n_of(w, cfg) // tn for w in w_refs]
  first_tile = [sum(tiles_of[:i]) for i in range(num_w)]
  n_tiles = sum(tiles_of)
  k_steps = k // tk // cfg.k_splits
  wg = lax.axis_index("wg")
  scaled = xs_gmem is not None

  def for_weight(n_all, fn):
    """fn(i, n tile within weight i) for the weight that N tile `n_all` belongs to."""
    if num_w == 1:
      return fn(0, n_all)
    for i in range(num_w):
      @pl.when((n_all >= first_tile[i]) & (n_all < first_tile[i] + tiles_of[i]))
      def _(i=i):
        fn(i, n_all - first_tile[i])

  @plgpu.nd_loop((m_tiles * n_tiles * cfg.k_splits,), collective_axes="sm")
  def _work_item(info: plgpu.NDLoopInfo):
    (linear,) = info.index
    local = info.local_index
    tile, split = linear // cfg.k_splits, linear % cfg.k_splits
    m_idx, n_all = tile % m_tiles, tile // m_tiles
    rows = pl.ds(m_idx * tm, tm)
    cols_of = lambda n_idx: pl.ds(n_idx * tn, tn)
    acc_slot = lax.rem(local, 2)
    acc = acc_tmem.at[:, pl.ds(acc_slot * tn, tn)]

    @pl.when(wg == MMA_WG)
    def _():
      @plgpu.warp_map
      def _per_warp(warp):
        @pl.when(warp == PRODUCER_WARP)
        def _produce():
          def step(ki, _):
            slot = lax.rem(ki, cfg.stages)

            @pl.when((ki >= cfg.stages) | (local > 0))  # the slot's previous MMA must be done
            def _():
              plgpu.barrier_wait(consumed.at[slot])
            kk = pl.ds((split * k_steps + ki) * tk, tk)
            plgpu.copy_gmem_to_smem(x_gmem.at[rows, kk], x_smem.at[slot], loaded.at[slot])

            def load_w(i, n_idx):
              w_gmem, cols = w_refs[i], cols_of(n_idx)
              w_tile = w_gmem.at[kk, cols] if cfg.w_kn else w_gmem.at[cols, kk]
              plgpu.copy_gmem_to_smem(w_tile, w_smem.at[slot], loaded.at[slot])
            for_weight(n_all, load_w)
          lax.fori_loop(0, k_steps, step, None)

        @pl.when((warp == MMA_WARP) & (local > 1))  # the epilogue still reads this buffer
        def _():
          plgpu.barrier_wait(store_done.at[acc_slot])

        @pl.when(warp == MMA_WARP)
        def _mma():
          def step(ki, _):
            slot = lax.rem(ki, cfg.stages)
            plgpu.barrier_wait(loaded.at[slot])
            w_tile = w_smem.at[slot] if cfg.w_kn else w_smem.at[slot].T
            plgpu.tcgen05_mma(acc, x_smem.at[slot], w_tile, consumed.at[slot], accumulate=ki > 0)

            @pl.when(ki == k_steps - 1)
            def _():
              plgpu.tcgen05_commit_arrive(mma_done.at[acc_slot])
          lax.fori_loop(0, k_steps, step, None)

    def epilogue(i, n_idx):
      ws_gmem, out_gmem, cols = w_scales[i], outs[i], cols_of(n_idx)
      if scaled:
        plgpu.copy_gmem_to_smem(xs_gmem.at[rows], row_scale_smem, scales_loaded.at[0])
        plgpu.copy_gmem_to_smem(ws_gmem.at[cols], col_scale_smem, scales_loaded.at[1])
        plgpu.barrier_wait(scales_loaded.at[0])
        plgpu.barrier_wait(scales_loaded.at[1])
        row_scale = row_scale_smem[...]
      dst = (out_gmem.at[split] if cfg.k_splits > 1 else out_gmem).at[rows, cols]
      plgpu.barrier_wait(mma_done.at[acc_slot])
      for j in range(tn // epi_n):
        piece = pl.ds(j * epi_n, epi_n)
        values = plgpu.async_load_tmem(acc.at[:, piece])
        if scaled:
          shape = (tm, epi_n)
          values = (values * lax.broadcast_in_dim(row_scale, shape, (0,))
                    * lax.broadcast_in_dim(col_scale_smem[piece], shape, (1,)))
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the store from this buffer is done
        out_smem[j % 2] = values.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[j % 2], dst.at[:, piece])
      plgpu.wait_load_tmem()
      plgpu.barrier_arrive(store_done.at[acc_slot])
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # scale buffers are reused next tile

    @pl.when(wg == EPILOGUE_WG)
    def _():
      for_weight(n_all, epilogue)

  plgpu.wait_smem_to_gmem(0)


def gemm(x, w, x_scale, w_scale, *, cfg: Config, out_dtype) -> jax.Array:
  """Same contract as sm90.gemm (`cfg` from `config_for`: 128-row tiles)."""
  m_pad, _ = x.shape
  n = w.shape[1] if cfg.w_kn else w.shape[0]
  return gemm_many(x, (w,), x_scale, None if w_scale is None else (w_scale,), cfg=cfg,
                   out_dtype=out_dtype)[0]


def gemm_many(x, ws, x_scale, w_scales, *, cfg: Config, out_dtype,
              scale_partials: bool = False) -> tuple[jax.Array, ...]:
  """Same contract as sm90.gemm_many (`cfg` from `config_for`)."""
  m_pad, _ = x.shape
  w = ws[0]
  out_type = out_types(m_pad, [_n_of(v, cfg) for v in ws], cfg, out_dtype)
  if cfg.k_splits > 1:  # f32 partials, the scales applied to each (a linear map) or after
    out_dtype = jnp.float32
    if not scale_partials:
      x_scale, w_scales = None, None
  tn, tk = cfg.tile_n, cfg.tile_k
  epi_n = epilogue_n(tn)
  in_tf = _transforms(tk, x.dtype)
  scratch = dict(
      x_smem=plgpu.SMEM((cfg.stages, TILE_M, tk), x.dtype, transforms=in_tf),
      w_smem=plgpu.SMEM((cfg.stages, tk, tn) if cfg.w_kn else (cfg.stages, tn, tk), w.dtype,
                        transforms=_transforms(tn, w.dtype) if cfg.w_kn else in_tf),
      acc_tmem=plgpu.TMEM((TILE_M, 2 * tn), jnp.float32),
      out_smem=plgpu.SMEM((2, TILE_M, epi_n), out_dtype, transforms=_transforms(epi_n, out_dtype)),
      row_scale_smem=plgpu.SMEM((TILE_M,), jnp.float32),
      col_scale_smem=plgpu.SMEM((tn,), jnp.float32),
      loaded=plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),
      consumed=plgpu.Barrier(num_barriers=cfg.stages, orders_tensor_core=True),
      mma_done=plgpu.Barrier(num_barriers=2, orders_tensor_core=True),
      store_done=plgpu.Barrier(num_barriers=2, orders_tensor_core=True),
      scales_loaded=plgpu.Barrier(num_barriers=2),
  )
  kernel = plgpu.kernel(
      functools.partial(_body, cfg=cfg, out_dtype=out_dtype, epi_n=epi_n, num_w=len(ws)),
      out_type=out_type,
      grid=(common.num_sms(),),
      grid_names=("sm",),
      num_threads=2,
      thread_name="wg",
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  if x_scale is None:
    return kernel(x, *ws, None, *([None] * len(ws)))
  return kernel(x, *ws, x_scale, *w_scales)
