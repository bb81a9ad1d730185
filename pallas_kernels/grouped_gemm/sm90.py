"""Hopper (sm_90) grouped GEMM: a persistent Mosaic GPU kernel with TMA, swizzled SMEM, a
multi-stage K pipeline and wgmma.

Work decomposition: the device-side schedule (schedule.py) lists (group, row block, owned rows)
tiles; the kernel runs `nd_loop` over tiles x N-blocks, one CTA per SM. Each step loads the row
block of x and the (tile_n, tile_k) K-major slices of that group's weight through an
`emit_pipeline` (TMA into 128-byte-swizzled SMEM, `max_concurrent_steps` stages) and accumulates
with wgmma in registers. FP8 wgmma needs both operands K-major, so weights stay (E, N, K) and the
B operand is `w_smem.T`.

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
  tile_m: int = 64  # one warpgroup's wgmma M; also the row block of the schedule
  tile_n: int = 128
  tile_k: int | None = None  # None: 128 bytes of K (one 128-byte swizzle row)
  max_concurrent_steps: int = 4


def k_alignment(dtype) -> int:
  """K must be a multiple of this: one 128-byte swizzle row of the operand dtype."""
  return 128 // jnp.dtype(dtype).itemsize


def n_alignment() -> int:
  return 64


def default_config(num_rows: int, n: int) -> Config:
  tile_n = 128 if n % 128 == 0 else 64
  return Config(tile_n=tile_n)


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


def grouped_matmul(x, w, group_sizes, x_scale, w_scale, out_dtype, config: Config | None = None):
  """x [A, K], w [E, N, K] (same dtype: bf16, or e4m3 with x_scale [A], w_scale [E, N]) -> [A, N]."""
  return _grouped_kernel(x, (w,), group_sizes, x_scale, (w_scale,), out_dtype,
                         lambda acc: acc, config)


def _silu_times(gate, up):
  return gate / (1.0 + jnp.exp(-gate)) * up


def grouped_swiglu(x, w_gate, w_up, group_sizes, x_scale, gate_scale, up_scale, out_dtype,
                   config: Config | None = None):
  """silu(x @ w_gate[g]^T) * (x @ w_up[g]^T), each product scaled like grouped_matmul: two
  accumulators share each x tile, and only the [A, F] product leaves the SM."""
  return _grouped_kernel(x, (w_gate, w_up), group_sizes, x_scale, (gate_scale, up_scale),
                         out_dtype, _silu_times, config)


def _grouped_kernel(x, weights, group_sizes, x_scale, w_scales, out_dtype, combine, config):
  """The shared kernel: one accumulator per weight (same shape), scaled accumulators are
  combined elementwise by `combine` in the epilogue."""
  num_rows, k = x.shape
  num_groups, n, _ = weights[0].shape
  cfg = config or default_config(num_rows, n)
  tile_m, tile_n = cfg.tile_m, cfg.tile_n
  tile_k = cfg.tile_k or k_alignment(x.dtype)
  assert k % tile_k == 0 and n % tile_n == 0, (k, tile_k, n, tile_n)
  scaled = x_scale is not None
  num_w = len(weights)
  num_tiles = sched_lib.padded_tiles(num_rows, num_groups, tile_m)
  num_n_blocks = n // tile_n
  k_steps = k // tile_k

  schedule = sched_lib.tile_schedule(group_sizes, num_rows, tile_m)
  # Whole row blocks are loaded, so pad x (and its scales) to a multiple of tile_m rows; the pad
  # rows are computed but never stored. No copy when A is already a multiple (prefill shapes).
  padded_rows = -(-num_rows // tile_m) * tile_m
  if padded_rows != num_rows:
    x = jnp.pad(x, ((0, padded_rows - num_rows), (0, 0)))
    if scaled:
      x_scale = jnp.pad(x_scale, (0, padded_rows - num_rows))
  transforms = _transforms(x.dtype, tile_k)
  # Keep one wgmma in flight while the next is issued: its SMEM slot is released one step late.
  delay = 1 if k_steps > 1 else 0

  def body(sched_gmem, x_gmem, *rest):
    w_gmems, rest = rest[:num_w], rest[num_w:]
    if scaled:
      xs_gmem, ws_gmems, o_gmem = rest[0], rest[1:1 + num_w], rest[-1]
    else:
      (o_gmem,) = rest

    def tile_products(acc_refs, group, block, ni):
      def step(_, x_smem, *w_smems):
        for acc_ref, w_smem in zip(acc_refs, w_smems):
          plgpu.wgmma(acc_ref, x_smem, w_smem.T)  # B K-major: FP8 wgmma needs it
        plgpu.wgmma_wait(delay * num_w)

      w_spec = plgpu.BlockSpec((tile_n, tile_k), lambda kk: (ni, kk), transforms=transforms,
                               delay_release=delay)
      plgpu.emit_pipeline(
          step,
          grid=(k_steps,),
          in_specs=[
              plgpu.BlockSpec((tile_m, tile_k), lambda kk: (block, kk), transforms=transforms,
                              delay_release=delay),
              *([w_spec] * num_w),
          ],
          max_concurrent_steps=max(cfg.max_concurrent_steps, delay + 1),
      )(x_gmem, *(w_gmem.at[group] for w_gmem in w_gmems))

    def scoped(sched_smem, o_smem, scale_smem, sched_bar, scale_bar):
      plgpu.copy_gmem_to_smem(sched_gmem, sched_smem, sched_bar)
      plgpu.barrier_wait(sched_bar)

      @plgpu.nd_loop((num_tiles * num_n_blocks,), collective_axes="sm")
      def _tile_loop(info):
        (lin,) = info.index
        tile = lin // num_n_blocks
        ni = lin % num_n_blocks
        group = sched_smem[sched_lib.GROUP, tile]
        block = sched_smem[sched_lib.BLOCK, tile]
        lo = sched_smem[sched_lib.ROW_LO, tile]
        hi = sched_smem[sched_lib.ROW_HI, tile]
        used = hi > lo

        def store(value):
          # The previous step's TMA stores must have read o_smem before it is overwritten.
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
          o_smem[...] = value.astype(o_smem.dtype)
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

          def acc_scope(*acc_refs):
            tile_products(acc_refs, group, block, ni)
            return tuple(acc_ref[...] for acc_ref in acc_refs)

          accs = pl.run_scoped(acc_scope,
                               *[plgpu.ACC((tile_m, tile_n), jnp.float32)] * num_w)
          if scaled:
            plgpu.barrier_wait(scale_bar)
            row_scale = lax.broadcast_in_dim(xs_smem[...], (tile_m, tile_n), (0,))
            accs = [acc * row_scale * lax.broadcast_in_dim(ws_smem[...], (tile_m, tile_n), (1,))
                    for acc, ws_smem in zip(accs, ws_smems)]
          store(combine(*accs))

        @pl.when(used & (group < 0))
        def _zero_tail():
          store(jnp.zeros((tile_m, tile_n), jnp.float32))

      plgpu.wait_smem_to_gmem(0)

    scale_allocs = None
    if scaled:
      scale_allocs = (plgpu.SMEM((tile_m,), jnp.float32),
                      *[plgpu.SMEM((tile_n,), jnp.float32)] * num_w)
    pl.run_scoped(
        scoped,
        plgpu.SMEM(schedule.shape, jnp.int32),
        plgpu.SMEM((tile_m, tile_n), out_dtype),
        scale_allocs,
        plgpu.Barrier(num_arrivals=1),  # the schedule copy
        plgpu.Barrier(num_arrivals=1 + num_w) if scaled else None,  # a tile's scale copies
    )

  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((num_rows, n), out_dtype),
      grid=(common.num_sms(),),
      grid_names=("sm",),
  )
  args = (schedule, x, *weights) + ((x_scale, *w_scales) if scaled else ())
  return kernel(*args)
