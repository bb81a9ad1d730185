"""`quantize_rows`: dynamic per-row FP8 quantization of a GEMM's input, padded to the GEMM's row
tile, in one launch (the decode path's glue: XLA takes a reduction and a convert, plus a pad when
it does not fuse)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.common import check
from pallas_kernels.quantize_rows import kernel, reference

FP8 = reference.FP8
# Decode / verify rows: one block a row. Prefill's thousands of rows stay with XLA, where the two
# launches are nothing next to the GEMM.
MAX_ROWS = 1024
_KERNEL = common.lowered_once(kernel.quantize, ("rows_out", "ub"))
_SWIGLU_KERNEL = common.lowered_once(kernel.swiglu_quantize, ("m", "rows_out", "ub"))
_BOTH_KERNEL = common.lowered_once(kernel.swiglu_and_rows_quantize,
                                   ("m", "rows_out", "m_x", "rows_out_x", "ub"))


def pallas_support(m: int, k: int, rows_out: int, dtype) -> tuple[bool, str]:
  """(supported, why not) for the kernel on x [m, k] padded to `rows_out` rows."""
  if kernel.vec_size(k) is None or k // kernel.WARPGROUP > kernel.MAX_PER_THREAD:
    return False, (f"K={k}: the kernel takes a multiple of {kernel.WARPGROUP} up to "
                   f"{kernel.WARPGROUP * kernel.MAX_PER_THREAD}")
  if not 1 <= m <= rows_out <= MAX_ROWS:
    return False, f"{m} rows padded to {rows_out}; the kernel takes 1 <= rows <= {MAX_ROWS}"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
    return False, f"x dtype {jnp.dtype(dtype)}; the kernel takes bf16 or f32"
  return True, ""


def quantize_rows(x, rows_out: int | None = None, ub: float | None = None, *,
                  implementation: str | None = None):
  """x [M, K] -> (e4m3 [rows_out, K], f32 scales [rows_out]): row i is x[i] / s[i] clipped to
  +-448 with s[i] = clip(max |x[i]|, 1/512, ub) / 448; rows M.. rows_out-1 are zero rows (what
  quantizing a zero-padded x gives). `rows_out` default M; `ub`: the optional cap on a row's max."""
  check(x.ndim == 2 and jnp.issubdtype(x.dtype, jnp.floating),
        f"quantize_rows: x has shape {x.shape} dtype {x.dtype}; pass float rows [M, K]")
  m, k = x.shape
  rows_out = m if rows_out is None else rows_out
  check(rows_out >= m, f"quantize_rows: rows_out={rows_out} is fewer than x's {m} rows")
  check(ub is None or ub > 0, f"quantize_rows: ub={ub!r}; pass a positive cap or None")
  ok, why = pallas_support(m, k, rows_out, x.dtype)
  if common.resolve(implementation, supported=ok, why=why) == "xla":
    return reference.quantize_rows(x, rows_out, ub)
  return _KERNEL(x, rows_out=rows_out, ub=ub)


def swiglu_quantize_rows(gate, up, x_scale=None, gate_scale=None, up_scale=None, *, m: int,
                         rows_out: int, ub: float | None = None,
                         implementation: str | None = None):
  """The FP8 input of an MLP's down projection straight from its gate / up GEMM outputs:
  gate, up [S, R >= m, N] (S split-K f32 partials, or S = 1 and the finished product), with
  x_scale [R] and gate_scale / up_scale [N] the GEMM's epilogue scales still to apply (all or
  none: `gemm.gemm_many_partials` scales each partial itself) ->
  (e4m3 [rows_out, N], f32 scales [rows_out]) = quantize_rows(silu(g) * u) of the first m rows
  with g, u the bf16 products (`reference.swiglu_quantize_rows`), in one launch."""
  check(gate.ndim == 3 and up.shape == gate.shape,
        f"swiglu_quantize_rows: gate {gate.shape} and up {up.shape} must be the same [S, R, N]")
  _, r, n = gate.shape
  scales = (x_scale, gate_scale, up_scale)
  check(len({s is None for s in scales}) == 1,
        "swiglu_quantize_rows: pass x_scale, gate_scale and up_scale together, or none")
  if x_scale is not None:
    check(x_scale.shape == (r,) and gate_scale.shape == (n,) and up_scale.shape == (n,),
          f"swiglu_quantize_rows: scales x {x_scale.shape}, gate {gate_scale.shape}, up "
          f"{up_scale.shape}; expected x [{r}] and gate / up [{n}]")
  check(1 <= m <= r and rows_out >= m,
        f"swiglu_quantize_rows: m={m}, rows_out={rows_out} for {r} rows; need 1 <= m <= {r} "
        f"and rows_out >= m")
  check(ub is None or ub > 0, f"swiglu_quantize_rows: ub={ub!r}; pass a positive cap or None")
  ok, why = pallas_support(m, n, rows_out, jnp.float32)
  if x_scale is not None:
    scales = tuple(s.astype(jnp.float32) for s in scales)
  if common.resolve(implementation, supported=ok, why=why) == "xla":
    return reference.swiglu_quantize_rows(gate, up, *scales, m, rows_out, ub)
  return _SWIGLU_KERNEL(gate, up, *scales, m=m, rows_out=rows_out, ub=ub)


def swiglu_and_quantize_rows(gate, up, x, *, m: int, rows_out: int, rows_out_x: int,
                             ub: float | None = None, implementation: str | None = None):
  """`swiglu_quantize_rows(gate, up, m=m, rows_out=rows_out, ub=ub)` (gate / up as
  `gemm.gemm_many_partials` leaves them: no scales to apply) and `quantize_rows(x, rows_out_x,
  ub)` of x [M_x, K] in one launch -> (h e4m3 [rows_out, N], its scales, x e4m3
  [rows_out_x, K], its scales). A MoE layer's shared-expert SwiGLU and its routed experts' down
  input are quantized back to back: one launch instead of two."""
  check(gate.ndim == 3 and up.shape == gate.shape and x.ndim == 2,
        f"swiglu_and_quantize_rows: gate {gate.shape}, up {up.shape}, x {x.shape}; expected "
        "[S, R, N] twice and [M, K]")
  check(1 <= m <= gate.shape[1] and rows_out >= m and rows_out_x >= x.shape[0],
        f"swiglu_and_quantize_rows: m={m}, rows_out={rows_out}, rows_out_x={rows_out_x} for "
        f"{gate.shape[1]} and {x.shape[0]} rows")
  check(ub is None or ub > 0, f"swiglu_and_quantize_rows: ub={ub!r}; pass a positive cap or None")
  ok_h, why_h = pallas_support(m, gate.shape[2], rows_out, jnp.float32)
  ok_x, why_x = pallas_support(*x.shape, rows_out_x, x.dtype)
  impl = common.resolve(implementation, supported=ok_h and ok_x, why=why_h or why_x)
  if impl == "xla":
    return (*reference.swiglu_quantize_rows(gate, up, None, None, None, m, rows_out, ub),
            *reference.quantize_rows(x, rows_out_x, ub))
  return _BOTH_KERNEL(gate, up, x, m=m, rows_out=rows_out, m_x=x.shape[0],
                      rows_out_x=rows_out_x, ub=ub)
