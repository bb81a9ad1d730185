"""The Mosaic GPU kernel: one warpgroup per output row.

A block loads its row (a whole row sits in registers: K <= 16,384 is at most 128 elements a
thread), reduces max |x| across the warpgroup, and writes the e4m3 row and its scale. Blocks
past the input's rows write the zero row a zero-padded input would give (scale MIN_ROW_AMAX /
448), so the GEMM after it gets its tile-padded rows without a pad launch. XLA spends two launches
on the same (the max reduction, then the scaled convert: a reduction's result cannot feed an
elementwise consumer of the reduced operand in one XLA fusion).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.quantize_rows import reference

WARPGROUP = 128
VEC_SIZES = (8, 4, 2, 1)
MAX_PER_THREAD = 128  # elements of a row per thread, in registers


def vec_size(k: int) -> int | None:
  """The widest vector that tiles a row of `k` over one warpgroup, or None."""
  return next((v for v in VEC_SIZES if k % (WARPGROUP * v) == 0), None)


def quantize(x, rows_out: int, ub: float | None):
  """x [M, K] bf16 / f32 -> (e4m3 [rows_out, K], f32 [rows_out])."""
  m, k = x.shape
  layout = plgpu.Layout.WG_STRIDED((k,), vec_size=vec_size(k))

  def body(x_ref, q_ref, s_ref):
    common.pdl_prologue()
    row = lax.axis_index("rows")
    xf = plgpu.layout_cast(x_ref[jnp.minimum(row, m - 1)], layout).astype(jnp.float32)
    xf = xf * (row < m).astype(jnp.float32)  # a scalar factor: where() cannot broadcast here
    amax = jnp.maximum(jnp.max(jnp.abs(xf)), reference.MIN_ROW_AMAX)
    if ub is not None:
      amax = jnp.minimum(amax, ub)
    s = amax / reference.FP8_MAX
    q_ref[row] = jnp.clip(xf / s, -reference.FP8_MAX, reference.FP8_MAX).astype(reference.FP8)
    s_ref[row] = s

  out = (jax.ShapeDtypeStruct((rows_out, k), reference.FP8),
         jax.ShapeDtypeStruct((rows_out,), jnp.float32))
  return plgpu.kernel(body, out_type=out, grid=(rows_out,), grid_names=("rows",))(x)
