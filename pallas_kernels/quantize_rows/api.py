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
