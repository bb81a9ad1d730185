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
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.quantize_rows import reference

WARPGROUP = 128
VEC_SIZES = (8, 4, 2, 1)
MAX_PER_THREAD = 128  # elements of a row per thread, in registers


def vec_size(k: int) -> int | None:
  """The widest vector that tiles a row of `k` over one warpgroup, or None."""
  return next((v for v in VEC_SIZES if k % (WARPGROUP * v) == 0), None)


def row_scale(amax, ub: float | None):
  """The scale of a row whose max |x| is `amax` (floored, capped at `ub`, mapped to 448)."""
  amax = jnp.maximum(amax, reference.MIN_ROW_AMAX)
  if ub is not None:
    amax = jnp.minimum(amax, ub)
  return amax / reference.FP8_MAX


def write_quantized(xf, row, q_ref, s_ref, ub: float | None):
  """Row `row` of the e4m3 output and its scale from the f32 row `xf` in registers."""
  s = row_scale(jnp.max(jnp.abs(xf)), ub)
  q_ref[row] = jnp.clip(xf / s, -reference.FP8_MAX, reference.FP8_MAX).astype(reference.FP8)
  s_ref[row] = s


def _quantize_row(x_ref, row, m, q_ref, s_ref, ub):
  """Row `row` of quantize's output from x_ref [M, K] (rows past m: the zero row)."""
  k = x_ref.shape[1]
  layout = plgpu.Layout.WG_STRIDED((k,), vec_size=vec_size(k))
  xf = plgpu.layout_cast(x_ref[jnp.minimum(row, m - 1)], layout).astype(jnp.float32)
  xf = xf * (row < m).astype(jnp.float32)  # a scalar factor: where() cannot broadcast here
  write_quantized(xf, row, q_ref, s_ref, ub)


def quantize(x, rows_out: int, ub: float | None):
  """x [M, K] bf16 / f32 -> (e4m3 [rows_out, K], f32 [rows_out])."""
  m, k = x.shape

  def body(x_ref, q_ref, s_ref):
    common.pdl_prologue()
    _quantize_row(x_ref, lax.axis_index("rows"), m, q_ref, s_ref, ub)

  out = (jax.ShapeDtypeStruct((rows_out, k), reference.FP8),
         jax.ShapeDtypeStruct((rows_out,), jnp.float32))
  return plgpu.kernel(body, out_type=out, grid=(rows_out,), grid_names=("rows",))(x)


def _bf16(x):
  """Rounds f32 values to bf16 and back: the model's bf16 tensors between its ops."""
  return x.astype(jnp.bfloat16).astype(jnp.float32)


def swiglu_quantize(gate, up, x_scale, gate_scale, up_scale, m: int, rows_out: int,
                    ub: float | None):
  """gate / up [S, R, N] (a GEMM's S split-K f32 partials, or S = 1 and its finished product;
  with the epilogue scales x_scale [R], gate_scale / up_scale [N], or all three None) ->
  (e4m3 [rows_out, N], f32 [rows_out]): per row the split-K sum, scales, bf16 rounding and
  silu(g) * u as the model's bf16 ops give them, then quantize's per-row FP8. Rows m.. are
  zero rows. One launch where XLA took two (the SwiGLU fusion, which the sum and scales ride
  in, then the quantization); the row is in registers for both."""
  n = gate.shape[2]
  scaled = x_scale is not None

  def body(*refs):
    common.pdl_prologue()
    g_ref, u_ref, *scale_refs, q_ref, s_ref = refs
    _swiglu_row(g_ref, u_ref, scale_refs if scaled else None, lax.axis_index("rows"), m, q_ref,
                s_ref, ub)

  out = (jax.ShapeDtypeStruct((rows_out, n), reference.FP8),
         jax.ShapeDtypeStruct((rows_out,), jnp.float32))
  args = (gate, up) + ((x_scale, gate_scale, up_scale) if scaled else ())
  return plgpu.kernel(body, out_type=out, grid=(rows_out,), grid_names=("rows",))(*args)


def _swiglu_row(g_ref, u_ref, scale_refs, row, m, q_ref, s_ref, ub):
  """Row `row` of swiglu_quantize's output (rows past m: the zero row)."""
  splits, _, n = g_ref.shape
  layout = plgpu.Layout.WG_STRIDED((n,), vec_size=vec_size(n))
  src = jnp.minimum(row, m - 1)

  def product(p_ref, w_ref):
    acc = plgpu.layout_cast(p_ref[0, src], layout).astype(jnp.float32)
    for split in range(1, splits):
      acc = acc + plgpu.layout_cast(p_ref[split, src], layout).astype(jnp.float32)
    if scale_refs is not None:
      acc = acc * scale_refs[0][src] * plgpu.layout_cast(w_ref[...], layout)
    return _bf16(acc)

  gs_ref, us_ref = (None, None) if scale_refs is None else scale_refs[1:]
  g, u = product(g_ref, gs_ref), product(u_ref, us_ref)
  h = _bf16(_bf16(g / (1.0 + jnp.exp(-g))) * u)
  h = h * (row < m).astype(jnp.float32)  # pad rows: a zero row (a scalar factor, as above)
  write_quantized(h, row, q_ref, s_ref, ub)


def swiglu_and_rows_quantize(gate, up, x, m: int, rows_out: int, m_x: int, rows_out_x: int,
                             ub: float | None):
  """swiglu_quantize(gate, up) (unscaled partials) and quantize(x) in ONE launch: blocks
  0..rows_out-1 make the SwiGLU rows, the rest x's rows (a MoE layer's shared expert and its
  routed experts' down input: one launch where two ran back to back)."""
  n, k = gate.shape[2], x.shape[1]

  def body(g_ref, u_ref, x_ref, hq_ref, hs_ref, xq_ref, xs_ref):
    common.pdl_prologue()
    block = lax.axis_index("rows")

    @pl.when(block < rows_out)
    def _():
      _swiglu_row(g_ref, u_ref, None, block, m, hq_ref, hs_ref, ub)

    @pl.when(block >= rows_out)
    def _():
      _quantize_row(x_ref, block - rows_out, m_x, xq_ref, xs_ref, ub)

  out = (jax.ShapeDtypeStruct((rows_out, n), reference.FP8),
         jax.ShapeDtypeStruct((rows_out,), jnp.float32),
         jax.ShapeDtypeStruct((rows_out_x, k), reference.FP8),
         jax.ShapeDtypeStruct((rows_out_x,), jnp.float32))
  return plgpu.kernel(body, out_type=out, grid=(rows_out + rows_out_x,),
                      grid_names=("rows",))(gate, up, x)
