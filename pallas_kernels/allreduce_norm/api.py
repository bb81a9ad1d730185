"""`allreduce_residual_norm`: a tensor-parallel layer's row-parallel partial sums all-reduced over
the tensor axis, added to the residual stream and RMS-normed, in one kernel (TensorRT-LLM's
fused all-reduce + residual + RMSNorm). Called INSIDE shard_map on each device's shards.

The all-reduce payload has the residual stream's dtype: bf16 in a bf16 model (the kernel takes only
that) on both paths, half the bytes of f32 sums; the partials are rounded to it before the
reduce, the residual add and the norm run in f32. (An f32 model, as tests use, sends f32.) `residual_norm` is the same math with the sum given (one device; the kernel's
body without the multimem load, which GPU interpret mode can run).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import common
from pallas_kernels.allreduce_norm import kernel, reference
from pallas_kernels.common import check
from pallas_kernels.quantize_rows import reference as quantize_reference

PAYLOAD_DTYPE = reference.PAYLOAD_DTYPE
# Decode and verify rows (B x (K + 1) tokens): one block per row. Prefill (thousands of rows)
# keeps XLA's all-reduce, whose bandwidth-bound ring is the better fit there.
MAX_ROWS = 1024


def _terms(partial) -> tuple:
  return tuple(partial) if isinstance(partial, (tuple, list)) else (partial,)


def _validate(partial, residual, weight):
  rows = math.prod(residual.shape[:-1])
  terms = _terms(partial)
  check(residual.ndim >= 1 and len(terms) >= 1,
        f"allreduce_residual_norm: residual {residual.shape}; pass at least one partial term")
  for x in terms:
    # [S, R, D] equal to a 3-D residual's shape means S = 1 (R >= rows): either reading agrees.
    padded = x.ndim in (2, 3) and x.shape[-2] >= rows and x.shape[-1:] == residual.shape[-1:]
    check(x.shape == residual.shape or padded,
          f"allreduce_residual_norm: partial {x.shape} and residual {residual.shape} must have "
          f"the same shape [..., D] (or partial [R >= {rows}, D]: a GEMM's tile-padded rows, or "
          f"[S, R, D]: its S split-K partials, scaled)")
    check(jnp.issubdtype(x.dtype, jnp.floating),
          f"allreduce_residual_norm: partial has dtype {x.dtype}; it must be a float")
  check(weight.shape == residual.shape[-1:],
        f"allreduce_residual_norm: weight has shape {weight.shape}; it must be the norm's [D] = "
        f"{residual.shape[-1:]}")
  for name, a in (("residual", residual), ("weight", weight)):
    check(jnp.issubdtype(a.dtype, jnp.floating),
          f"allreduce_residual_norm: {name} has dtype {a.dtype}; it must be a float")


def pallas_support(shape, residual_dtype, weight_dtype) -> tuple[bool, str]:
  """(supported, why not) for the kernel on rows of `shape` [..., D]."""
  d, m = shape[-1], math.prod(shape[:-1])
  if kernel.vec_size(d) is None:
    return False, f"D={d} is not a multiple of {kernel.WARPGROUP * kernel.VEC_SIZES[-1]}"
  if not 1 <= m <= MAX_ROWS:
    return False, f"{m} rows; the kernel takes 1..{MAX_ROWS} (decode / verify)"
  if jnp.dtype(residual_dtype) != PAYLOAD_DTYPE or jnp.dtype(weight_dtype) != PAYLOAD_DTYPE:
    return False, f"residual / weight {residual_dtype} / {weight_dtype}; the kernel takes bf16"
  return True, ""


def _flat(fn, partial, residual, weight, padded_normed=False):
  """The kernel on [rows, D]; a row-padded partial goes in as it is (the kernel reads the first
  `rows`: slicing it would be a launch of its own), split-K partials [S, R, D] too, in f32
  (rounding them would be a launch). The quantized rows, if any, stay flat."""
  d = residual.shape[-1]
  def term(x):
    return x if reference.is_split(x, residual) else x.reshape(-1, d).astype(PAYLOAD_DTYPE)

  h, y, *quantized = fn(tuple(term(x) for x in _terms(partial)), residual.reshape(-1, d), weight)
  rows = math.prod(residual.shape[:-1])
  padded = (y,) if quantized and padded_normed else ()
  return (h.reshape(residual.shape), y[:rows].reshape(residual.shape), *quantized, *padded)


def _check_quantize(quantize, residual):
  if quantize is None:
    return
  rows = math.prod(residual.shape[:-1])
  check(len(quantize) == 2 and quantize[0] >= rows and (quantize[1] is None or quantize[1] > 0),
        f"allreduce_residual_norm: quantize={quantize!r}; pass (rows_out >= {rows}, ub > 0 or "
        f"None)")


def _with_quantized(out, quantize, padded_normed=False):
  """The reference's (h, y) and, with `quantize`, y's FP8 rows as the kernel writes them (and,
  `padded_normed`, y's rows zero-padded like them)."""
  if quantize is None:
    return out
  h, y = out
  y2 = y.reshape(-1, y.shape[-1])
  q, s = quantize_reference.quantize_rows(y2, *quantize)
  padded = (jnp.pad(y2, ((0, quantize[0] - y2.shape[0]), (0, 0))),) if padded_normed else ()
  return h, y, q, s, *padded


def residual_norm(summed, residual, weight, eps: float, *, implementation: str | None = None,
                  quantize=None, padded_normed: bool = False):
  """(residual + summed, RMSNorm of it times `weight`) on one device. `summed`: [..., D] like
  the residual, or [R, D] with R >= its rows (a GEMM's tile-padded output; the rest ignored), or
  split-K partials / a tuple of terms as `allreduce_residual_norm` takes them.
  `quantize` (rows_out, ub): also the normed rows quantized for an FP8 GEMM, as
  `pallas_kernels.quantize_rows(normed rows, rows_out, ub)`: (..., e4m3 [rows_out, D], f32
  scales [rows_out]); `padded_normed` (with quantize): then also the normed rows [rows_out, D],
  zero past the residual's rows (a bf16 GEMM on them pads nothing)."""
  _validate(summed, residual, weight)
  _check_quantize(quantize, residual)
  ok, why = pallas_support(residual.shape, residual.dtype, weight.dtype)
  if common.resolve(implementation, supported=ok, why=why) == "xla":
    return _with_quantized(reference.residual_norm(
        reference.local_sum(_terms(summed), residual), residual, weight, eps), quantize,
        padded_normed)
  return _flat(lambda x, r, w: kernel.fused(x, r, w, eps, quantize=quantize), summed, residual,
               weight, padded_normed)


new_semaphores = kernel.new_semaphores
shared_semaphores_supported = kernel.shared_semaphores_supported


def allreduce_residual_norm(partial, residual, weight, eps: float, axis_name, *,
                            implementation: str | None = None, semaphores=None, quantize=None,
                            padded_normed: bool = False):
  """Inside shard_map: (residual + psum(partial) over `axis_name`, its RMSNorm times `weight`).
  `partial` [..., D]: this device's row-parallel partial sums (any float dtype; sent in the
  residual's dtype), or [R, D] with R >= the residual's rows (a GEMM's tile-padded output), or
  [S, R, D] (a K-split GEMM's S f32 partials, each scaled: summed, sent in f32), or a tuple of
  such terms, summed (the routed and the shared experts' outputs of a MoE layer);
  `residual` [..., D] and `weight` [D]: replicated over `axis_name`. The kernel's multimem load
  reduces over every axis of the mesh, so `axis_name` must name all of them (the others of size
  1 may be left out by the caller's plan: see maverick.kernels.allreduce_norm_axes).
  `semaphores`: the kernel's semaphore buffer shared with the forward's other fused sites
  (`new_semaphores(rows)`, passed into shard_map), or None for its own (one more launch: XLA
  copies a zeroed buffer in). `quantize`, `padded_normed`: as `residual_norm`'s.
  """
  _validate(partial, residual, weight)
  _check_quantize(quantize, residual)
  if semaphores is not None:
    rows = math.prod(residual.shape[:-1])
    check(semaphores.shape == (2 * rows,),
          f"allreduce_residual_norm: semaphores {semaphores.shape}; these {rows} rows need "
          f"new_semaphores({rows}) ({2 * rows},)")
  ok, why = pallas_support(residual.shape, residual.dtype, weight.dtype)
  if common.resolve(implementation, supported=ok, why=why) == "xla":
    return _with_quantized(reference.allreduce_residual_norm(
        _terms(partial), residual, weight, eps, axis_name), quantize, padded_normed)
  axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  n = math.prod(lax.axis_size(a) for a in axes)
  return _flat(lambda x, r, w: kernel.fused(x, r, w, eps, collective_axes=axes, num_devices=n,
                                            semaphores=semaphores, quantize=quantize),
               partial, residual, weight, padded_normed)
