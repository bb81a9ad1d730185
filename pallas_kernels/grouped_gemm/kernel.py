"""The grouped GEMM kernel shared by Hopper (sm_90, wgmma, register accumulators) and Blackwell
(sm_100, tcgen05 MMA, TMEM accumulators): a persistent Mosaic GPU kernel with TMA, swizzled SMEM
and a multi-stage K pipeline. sm90.py / sm100.py pick the architecture and tile sizes.

Work decomposition: the device-side schedule (schedule.py) lists (group, row block, owned rows)
tiles; the kernel runs `nd_loop` over tiles x N-blocks, one CTA per SM. Each step loads the row
block of x and the (tile_n, tile_k) K-major slices of that group's weight through an
`emit_pipeline` (TMA into 128-byte-swizzled SMEM, `max_concurrent_steps` stages) and accumulates
with wgmma in registers (sm_90) or tcgen05 MMAs into TMEM (sm_100). FP8 MMAs need both operands
K-major, so weights stay (E, N, K) and the B operand is `w_smem.T`. One MMA stays in flight while
the next is issued: the pipeline releases each SMEM slot one step late (delay_release=1), after
that step's MMA is known complete (wgmma_wait(1) / a tensor-core barrier per step parity).

Epilogue: f32 accumulator x row scale x channel scale (FP8) -> out dtype -> unswizzled SMEM ->
TMA stores of only the owned rows, as a ladder of power-of-two row counts (TMA boxes are static;
the owned count is known at run time: each set bit of it is one store). Rows owned by another
group's tile are never written here, so neighbouring tiles of one block never race.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.grouped_gemm import schedule as sched_lib


@dataclasses.dataclass(frozen=True)
class Config:
  tile_m: int  # the MMA M (wgmma: 64 per warpgroup; tcgen05: 128), also the schedule's row block
  tile_n: int
  tile_k: int | None = None  # None: 128 bytes of K (one 128-byte swizzle row)
  max_concurrent_steps: int = 4
  epilogue_n: int | None = None  # columns per epilogue chunk (None: the whole tile)
  # Weights stored (E, K, N) (maverick.moe's layout), 16-bit only: wgmma/tcgen05 read the B tile
  # N-major, which FP8 MMAs do not allow. The (tile_k, tile_n) tile is swizzled along N, so
  # tile_n * itemsize must give the same 128-byte swizzle as the x tile's K row.
  w_kn: bool = False


def k_alignment(dtype) -> int:
  """K must be a multiple of this: one 128-byte swizzle row of the operand dtype."""
  return 128 // jnp.dtype(dtype).itemsize


def n_alignment() -> int:
  return 64


def _transforms(dtype, tile_k):
  swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(dtype).itemsize * 8)
  swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))


def _store_owned_rows(o_smem, o_gmem, row0, lo, hi, col0, tile_m, tile_n):
  """TMA-stores rows [lo, hi) of o_smem to o_gmem rows row0 + [lo, hi): one static-size store per
  set bit of hi - lo, largest first."""
  count = hi - lo
  start = lo
  size = tile_m
  while size >= 1:
    @pl.when((count & size) != 0)
    def _(start=start, size=size):
      plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, size)],
                              o_gmem.at[pl.ds(row0 + start, size), pl.ds(col0, tile_n)])
    start = start + (count & size)
    size //= 2


def silu_times(gate, up):
  return gate / (1.0 + jnp.exp(-gate)) * up


def _row_tile_fields(rg_gmem, tile, routed: int, num_rows: int, num_groups: int, tile_m: int):
  """schedule.row_schedule's (group, block, lo, hi) of `tile`, made in the kernel from the rows'
  groups in GMEM (a scalar load): no schedule array for XLA to build and pad first (a launch a
  MoE layer at decode). Tiles past the routed rows: the static zero tail, then unused ones."""
  routed_group = rg_gmem[jnp.minimum(tile, routed - 1)]
  routed_group = jnp.where((routed_group >= 0) & (routed_group < num_groups), routed_group,
                           sched_lib.ZERO_GROUP)
  is_routed = tile < routed
  group = jnp.where(is_routed, routed_group, sched_lib.ZERO_GROUP)
  block = jnp.where(is_routed, tile // tile_m, 0)
  lo = jnp.where(is_routed, tile % tile_m, 0)
  hi = jnp.where(is_routed, tile % tile_m + 1, 0)
  tail_blocks = range(routed // tile_m, -(-num_rows // tile_m)) if num_rows > routed else ()
  for j, b in enumerate(tail_blocks):
    tail = tile == routed + j
    block = jnp.where(tail, b, block)
    lo = jnp.where(tail, max(routed - b * tile_m, 0), lo)
    hi = jnp.where(tail, min(num_rows - b * tile_m, tile_m), hi)
  return group, block, lo, hi


def grouped_kernel(x, weights, group_sizes, x_scale, w_scales, out_dtype, combine,
                   cfg: Config, arch: str, row_groups=None, row_weights=None):
  """[A, N] = combine(*(scaled x @ w[g]^T for w in weights)): one accumulator per weight (1 or 2,
  same shape), combined elementwise in the epilogue (identity, or silu(gate) * up). Rows sorted
  by group with `group_sizes`, or in any order with each row's group in `row_groups` [A' <= A]
  (schedule.row_schedule's tiles, one per row, for decode's few rows, made in the kernel; rows
  past A' are 0). `row_weights` [A'] (with row_groups): each routed row's products also scaled
  by its weight (the router's score, as if it scaled the input row)."""
  assert arch in ("sm90", "sm100"), arch
  num_rows, k = x.shape
  num_groups = weights[0].shape[0]
  n = weights[0].shape[2] if cfg.w_kn else weights[0].shape[1]
  tile_m, tile_n = cfg.tile_m, cfg.tile_n
  epilogue_n = cfg.epilogue_n or tile_n
  tile_k = cfg.tile_k or k_alignment(x.dtype)
  assert k % tile_k == 0 and n % tile_n == 0, (k, tile_k, n, tile_n)
  scaled = x_scale is not None
  num_w = len(weights)
  num_tiles = sched_lib.padded_tiles(num_rows, num_groups, tile_m)
  num_n_blocks = n // tile_n
  k_steps = k // tile_k

  by_row = row_groups is not None
  weighted = row_weights is not None
  assert by_row or not weighted
  if by_row:  # x may be padded past the routed rows: its tail rows are stored as zeros
    routed = row_groups.shape[0]
    assert routed + -(-num_rows // tile_m) - routed // tile_m <= num_tiles, (routed, num_rows)
    schedule = row_groups
  else:
    schedule = sched_lib.pack(sched_lib.tile_schedule(group_sizes, num_rows, tile_m))
  # Whole row blocks are loaded, so pad x (and its scales) to a multiple of tile_m rows; the pad
  # rows are computed but never stored. No copy when A is already a multiple (prefill shapes).
  padded_rows = -(-num_rows // tile_m) * tile_m
  if padded_rows != num_rows:
    x = jnp.pad(x, ((0, padded_rows - num_rows), (0, 0)))
    if scaled:
      x_scale = jnp.pad(x_scale, (0, padded_rows - num_rows))
  transforms = _transforms(x.dtype, tile_k)
  # Keep one MMA in flight while the next is issued: its SMEM slot is released one step late.
  delay = 1 if k_steps > 1 else 0

  def body(sched_gmem, x_gmem, *rest):
    common.pdl_prologue()
    w_gmems, rest = rest[:num_w], rest[num_w:]
    rw_gmem = None
    if weighted:
      rw_gmem, rest = rest[0], rest[1:]
    if scaled:
      xs_gmem, ws_gmems, o_gmem = rest[0], rest[1:1 + num_w], rest[-1]
    else:
      (o_gmem,) = rest

    def k_pipeline(step, group, block, ni):
      """Runs step(k_index, x_smem, *w_smems) over K with TMA prefetch of the next stages."""
      if cfg.w_kn:
        w_spec = plgpu.BlockSpec((tile_k, tile_n), lambda kk: (kk, ni),
                                 transforms=_transforms(x.dtype, tile_n), delay_release=delay)
      else:
        w_spec = plgpu.BlockSpec((tile_n, tile_k), lambda kk: (ni, kk), transforms=transforms,
                                 delay_release=delay)
      plgpu.emit_pipeline(
          lambda idx, x_smem, *w_smems: step(idx[0], x_smem, *w_smems),
          grid=(k_steps,),
          in_specs=[plgpu.BlockSpec((tile_m, tile_k), lambda kk: (block, kk),
                                    transforms=transforms, delay_release=delay),
                    *([w_spec] * num_w)],
          max_concurrent_steps=max(cfg.max_concurrent_steps, delay + 1),
      )(x_gmem, *(w_gmem.at[group] for w_gmem in w_gmems))

    def wgmma_products(group, block, ni):
      """sm_90: f32 accumulators in registers; returns a chunk reader over them."""
      def acc_scope(*acc_refs):
        def step(kk, x_smem, *w_smems):
          for acc_ref, w_smem in zip(acc_refs, w_smems):
            plgpu.wgmma(acc_ref, x_smem, w_smem if cfg.w_kn else w_smem.T)
          plgpu.wgmma_wait(delay * num_w)  # each wgmma is one group: the previous step's done
        k_pipeline(step, group, block, ni)
        return tuple(acc_ref[...] for acc_ref in acc_refs)

      accs = pl.run_scoped(acc_scope, *[plgpu.ACC((tile_m, tile_n), jnp.float32)] * num_w)
      return lambda i, cols: accs[i][:, cols.start:cols.start + cols.size]

    def tcgen05_products(acc_tmems, mma_bars, group, block, ni):
      """sm_100: f32 accumulators in TMEM; returns a chunk reader (TMEM -> registers)."""
      def step(kk, x_smem, *w_smems):
        for acc_tmem, w_smem in zip(acc_tmems, w_smems):
          plgpu.tcgen05_mma(acc_tmem, x_smem, w_smem if cfg.w_kn else w_smem.T,
                            accumulate=kk > 0)
        plgpu.tcgen05_commit_arrive(mma_bars.at[kk % 2])  # fires when this step's MMAs finish
        if delay:
          @pl.when(kk > 0)
          def _():  # the previous step's slot is released after this step returns
            plgpu.barrier_wait(mma_bars.at[(kk - 1) % 2])
        else:
          plgpu.barrier_wait(mma_bars.at[0])

      k_pipeline(step, group, block, ni)
      if delay:
        plgpu.barrier_wait(mma_bars.at[(k_steps - 1) % 2])
      return lambda i, cols: plgpu.async_load_tmem(acc_tmems[i].at[:, cols])

    def scoped(sched_smem, o_smem, scale_smem, sched_bar, scale_bar, mma_bars, acc_tmems):
      if not by_row:
        plgpu.copy_gmem_to_smem(sched_gmem, sched_smem, sched_bar)
        plgpu.barrier_wait(sched_bar)

      @plgpu.nd_loop((num_tiles * num_n_blocks,), collective_axes="sm")
      def _tile_loop(info):
        (lin,) = info.index
        tile = lin // num_n_blocks
        ni = lin % num_n_blocks
        if by_row:
          group, block, lo, hi = _row_tile_fields(sched_gmem, tile, routed, num_rows, num_groups,
                                                  tile_m)
        else:
          group, block, lo, hi = (
              sched_lib.read_packed(sched_smem, num_tiles, field, tile)
              for field in (sched_lib.GROUP, sched_lib.BLOCK, sched_lib.ROW_LO, sched_lib.ROW_HI))
        used = hi > lo

        def store(chunk_value):
          """chunk_value(cols) -> f32 [tile_m, len(cols)]; writes the tile's owned rows."""
          # The previous step's TMA stores must have read o_smem before it is overwritten.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          for c in range(tile_n // epilogue_n):
            cols = pl.ds(c * epilogue_n, epilogue_n)
            value = chunk_value(cols).astype(o_smem.dtype)
            if epilogue_n == tile_n:
              o_smem[...] = value
            else:
              o_smem[:, cols] = value
          if arch == "sm100":
            plgpu.wait_load_tmem()  # TMEM reads done before the next tile's MMAs overwrite it
          plgpu.commit_smem()  # also a warpgroup barrier: every thread is past the scale reads
          _store_owned_rows(o_smem, o_gmem, block * tile_m, lo, hi, ni * tile_n, tile_m, tile_n)

        @pl.when(used & (group >= 0))
        def _compute():
          if scaled:
            xs_smem, ws_smems = scale_smem[0], scale_smem[1:]
            # Scale loads overlap the K loop.
            plgpu.copy_gmem_to_smem(xs_gmem.at[pl.ds(block * tile_m, tile_m)], xs_smem, scale_bar)
            for ws_gmem, ws_smem in zip(ws_gmems, ws_smems):
              plgpu.copy_gmem_to_smem(ws_gmem.at[group, pl.ds(ni * tile_n, tile_n)], ws_smem,
                                      scale_bar)
          if arch == "sm90":
            read_acc = wgmma_products(group, block, ni)
          else:
            read_acc = tcgen05_products(acc_tmems, mma_bars, group, block, ni)
          if scaled:
            plgpu.barrier_wait(scale_bar)

          # A routed row's weight (its tile holds that one row): a scalar for the whole tile.
          weight = None
          if weighted:  # any float dtype: one scalar converted here, not an XLA launch before
            weight = rw_gmem[jnp.minimum(tile, routed - 1)].astype(jnp.float32)

          def chunk_value(cols):
            accs = [read_acc(i, cols) for i in range(num_w)]
            if scaled:
              shape = (tile_m, cols.size)
              row_scale = lax.broadcast_in_dim(xs_smem[...], shape, (0,))
              accs = [acc * row_scale * lax.broadcast_in_dim(ws_smem[cols], shape, (1,))
                      for acc, ws_smem in zip(accs, ws_smems)]
            if weighted:
              accs = [acc * weight for acc in accs]
            return combine(*accs)

          store(chunk_value)

        @pl.when(used & (group < 0))
        def _zero_tail():
          store(lambda cols: jnp.zeros((tile_m, cols.size), jnp.float32))

      plgpu.wait_smem_to_gmem(0)

    scale_allocs = None
    if scaled:
      scale_allocs = (plgpu.SMEM((tile_m,), jnp.float32),
                      *[plgpu.SMEM((tile_n,), jnp.float32)] * num_w)
    tensor_core_allocs = (None, None)
    if arch == "sm100":
      tensor_core_allocs = (
          plgpu.Barrier(num_barriers=2, orders_tensor_core=True),  # MMA done, by step parity
          [plgpu.TMEM((tile_m, tile_n), jnp.float32) for _ in range(num_w)])
    pl.run_scoped(
        scoped,
        None if by_row else plgpu.SMEM(schedule.shape, jnp.int32),
        plgpu.SMEM((tile_m, tile_n), out_dtype),
        scale_allocs,
        None if by_row else plgpu.Barrier(num_arrivals=1),  # the schedule copy
        plgpu.Barrier(num_arrivals=1 + num_w) if scaled else None,  # a tile's scale copies
        *tensor_core_allocs,
    )

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((num_rows, n), out_dtype),
      grid=(common.num_sms(),),
      grid_names=("sm",),
  )
  args = ((schedule, x, *weights) + ((row_weights,) if weighted else ())
          + ((x_scale, *w_scales) if scaled else ()))
  return kernel(*args)
