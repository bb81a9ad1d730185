"""`route_top1`: Llama 4's top-1 MoE routing (the argmax of the RAW router logits and the sigmoid
of the max as the score) straight from the router GEMM's output, K-split partials included, in
one launch: at decode the routing is glue between kernels, launch-bound."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.common import check
from pallas_kernels.moe_route import kernel, reference

MAX_ROWS = 1024  # decode / verify rows (one block a row)


def pallas_support(rows: int, experts: int) -> tuple[bool, str]:
  """(True, "") where the top-1 routing kernel takes `rows` x `experts`, else (False, why)."""
  if experts % kernel.WARPGROUP or experts > kernel.WARPGROUP * 128:
    return False, (f"{experts} experts: the kernel takes a multiple of {kernel.WARPGROUP} (one a "
                   f"thread), at most {kernel.WARPGROUP * 128}")
  if not 1 <= rows <= MAX_ROWS:
    return False, f"{rows} rows; the kernel takes 1..{MAX_ROWS} (decode / verify)"
  return True, ""


def route_top1(partials, rows: int, *, logits_dtype=jnp.bfloat16, score_dtype=jnp.bfloat16,
               implementation: str | None = None):
  """partials [S, R >= rows, E]: the router GEMM's output (S f32 K-split partials, each scaled,
  or S = 1 and the finished logits; rows past `rows` padding) -> (expert ids int32 [rows, 1],
  scores [rows, 1] in score_dtype): the logits rounded to `logits_dtype` (the model's bf16
  router output), their first argmax, and sigmoid(max) (`reference.route_top1`)."""
  check(partials.ndim == 3 and jnp.issubdtype(partials.dtype, jnp.floating),
        f"route_top1: partials {partials.shape} {partials.dtype}; pass the router GEMM's float "
        f"output [S, R, E]")
  check(1 <= rows <= partials.shape[1],
        f"route_top1: rows={rows} for partials of {partials.shape[1]} rows")
  ok, why = pallas_support(rows, partials.shape[2])
  if common.resolve(implementation, supported=ok, why=why) == "xla":
    return reference.route_top1(partials, rows, logits_dtype, score_dtype)
  top, score = _KERNEL(partials, rows=rows, logits_dtype=jnp.dtype(logits_dtype),
                       score_dtype=jnp.dtype(score_dtype))
  return top[:, None], score[:, None]


_KERNEL = common.lowered_once(kernel.route_top1, ("rows", "logits_dtype", "score_dtype"))
