"""The split-KV combine as one Mosaic GPU kernel, writing the attention output in its final
[B, T, H, Dh] layout.

XLA spends four launches on it (the max over splits, the weights, the weighted sums, and the
slice + transpose back out of the packed rows, which feeds a custom call and so is a copy of its
own). Here one warpgroup per packed query row (kv head k, row m = t * G + g) streams the P split
partials once with an online log-sum-exp (as flash-decoding's reduce step does): Dh = 128 is one
element a thread, the split's lse a scalar, nothing in shared memory.

An empty split (lse = -inf, a split past the row's last visible slot) weighs 0; a row that sees
no slot at all (never produced by the model) comes out 0, as the XLA combine gives.

With `quantize` the kernel also writes the O-projection's FP8 input (what quantize_rows gives on
y reshaped to token rows [B * T, H * Dh]): the grid is then one warpgroup per TOKEN, merging all
H of its heads in one pass over the splits (H heads' loads in flight per step) and keeping the
H rows in registers, so the token's max |y| is one warpgroup reduction and the separate
quantize launch goes away. Blocks past B * T write the zero pad rows of the GEMM's row tile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.quantize_rows import kernel as quantize_kernel
from pallas_kernels.quantize_rows.reference import FP8, FP8_MAX

WARPGROUP = 128
_FLOOR = -1e30  # the running max starts finite: exp2(-inf - floor) is 0, never NaN


MAX_PER_THREAD = 128  # a token's H * Dh values per thread, in registers (as quantize_rows)


def supported_head_dim(dh: int) -> bool:
  return dh % WARPGROUP == 0


def supports_quantize(heads: int, dh: int) -> bool:
  """Whether the quantize epilogue takes a token of `heads` heads of `dh`: the whole token row
  must sit in registers (at most MAX_PER_THREAD values a thread)."""
  return supported_head_dim(dh) and heads * dh // WARPGROUP <= MAX_PER_THREAD


def combine_rows(out, lse, *, batch: int, steps: int, groups: int, out_dtype,
                 quantize: tuple[int, float | None] | None = None):
  """out [P, B * K, Mpad, Dh] (each split's normalised partial), lse [P, B * K, Mpad] (log2
  units) -> [B, T=steps, H = K * groups, Dh] in out_dtype. `quantize` (rows_out >= B * T, ub):
  returns (y, q e4m3 [rows_out, H * Dh], s f32 [rows_out]) with q, s = quantize_rows(y
  reshaped to [B * T, H * Dh], rows_out, ub) (needs supports_quantize)."""
  if quantize is not None:
    return _combine_quantize(out, lse, batch=batch, steps=steps, groups=groups,
                             out_dtype=out_dtype, rows_out=quantize[0], ub=quantize[1])
  P, BK, _, dh = out.shape
  K, G, M = BK // batch, groups, steps * groups
  layout = plgpu.Layout.WG_STRIDED((dh,), vec_size=dh // WARPGROUP)

  def body(o_ref, lse_ref, y_ref):
    common.pdl_prologue()
    bk, m = lax.axis_index("bk"), lax.axis_index("m")

    def split(p, carry):
      mx, den, acc = carry
      l = lse_ref[p, bk, m]
      new = jnp.maximum(mx, l)
      keep, w = jnp.exp2(mx - new), jnp.exp2(l - new)
      o = plgpu.layout_cast(o_ref[p, bk, m], layout).astype(jnp.float32)
      return new, den * keep + w, acc * keep + o * w

    zeros = plgpu.layout_cast(jnp.zeros((dh,), jnp.float32), layout)
    _, den, acc = lax.fori_loop(0, P, split, (jnp.float32(_FLOOR), jnp.float32(0.0), zeros))
    inv = 1.0 / jnp.maximum(den, 1e-30)  # den == 0 only with acc == 0: the row comes out 0
    y_ref[bk // K, m // G, (bk % K) * G + m % G] = (acc * inv).astype(out_dtype)

  y = jax.ShapeDtypeStruct((batch, steps, K * G, dh), out_dtype)
  return plgpu.kernel(body, out_type=y, grid=(BK, M), grid_names=("bk", "m"))(out, lse)


def _combine_quantize(out, lse, *, batch, steps, groups, out_dtype, rows_out, ub):
  """combine_rows with the quantize epilogue: one warpgroup per token row r = b * T + t."""
  P, BK, _, dh = out.shape
  K, G, T = BK // batch, groups, steps
  H, tokens = K * G, batch * steps
  common.check(supports_quantize(H, dh), f"combine_rows quantize: {H} heads x Dh={dh} is more "
               f"than {MAX_PER_THREAD} values a thread (or Dh not a multiple of {WARPGROUP})")
  layout = plgpu.Layout.WG_STRIDED((dh,), vec_size=dh // WARPGROUP)

  def body(o_ref, lse_ref, y_ref, q_ref, s_ref):
    common.pdl_prologue()
    row = lax.axis_index("rows")

    @pl.when(row < tokens)
    def _():
      b, t = row // T, row % T
      # Head h = k * G + g is packed row m = t * G + g of kv head bk = b * K + k.
      at = [(b * K + h // G, t * G + h % G) for h in range(H)]

      def split(p, carry):  # all H heads in one loop: H independent loads a step, not H loops
        new_carry = []
        for (bk, m), (mx, den, acc) in zip(at, carry):
          l = lse_ref[p, bk, m]
          new = jnp.maximum(mx, l)
          keep, w = jnp.exp2(mx - new), jnp.exp2(l - new)
          o = plgpu.layout_cast(o_ref[p, bk, m], layout).astype(jnp.float32)
          new_carry.append((new, den * keep + w, acc * keep + o * w))
        return new_carry

      zeros = plgpu.layout_cast(jnp.zeros((dh,), jnp.float32), layout)
      init = [(jnp.float32(_FLOOR), jnp.float32(0.0), zeros) for _ in range(H)]
      carry = lax.fori_loop(0, P, split, init)
      ys = []
      for h, (_, den, acc) in enumerate(carry):
        y = (acc * (1.0 / jnp.maximum(den, 1e-30))).astype(out_dtype)
        y_ref[b, t, h] = y
        ys.append(y.astype(jnp.float32))  # quantize the rounded y: q agrees with y's own
      big = jnp.abs(ys[0])
      for y in ys[1:]:
        big = jnp.maximum(big, jnp.abs(y))
      scale = quantize_kernel.row_scale(jnp.max(big), ub)  # one warpgroup reduction a token
      for h, y in enumerate(ys):
        q_ref[row, h] = jnp.clip(y / scale, -FP8_MAX, FP8_MAX).astype(FP8)
      s_ref[row] = scale

    @pl.when(row >= tokens)
    def _():  # the GEMM's tile padding: what quantizing a zero row gives
      zero = plgpu.layout_cast(jnp.zeros((dh,), jnp.float32), layout).astype(FP8)
      for h in range(H):
        q_ref[row, h] = zero
      s_ref[row] = quantize_kernel.row_scale(jnp.float32(0.0), ub)

  out_types = (jax.ShapeDtypeStruct((batch, steps, H, dh), out_dtype),
               jax.ShapeDtypeStruct((rows_out, H, dh), FP8),  # [rows_out, H * Dh], head major
               jax.ShapeDtypeStruct((rows_out,), jnp.float32))
  y, q, s = plgpu.kernel(body, out_type=out_types, grid=(rows_out,),
                         grid_names=("rows",))(out, lse)
  return y, q.reshape(rows_out, H * dh), s
