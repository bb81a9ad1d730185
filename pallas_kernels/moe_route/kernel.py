"""The Mosaic GPU kernel: one warpgroup per row; E experts a row in registers (E = 128: one a
thread). The split-K sum, the bf16 rounding of the logits, their max and first argmax (a max
reduction, then a min over the indices holding it) and the score's sigmoid: one launch where
XLA takes the split-K sum and a reduction (and the GEMV itself, two more, without the GEMM
kernel before this)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common

WARPGROUP = 128


def route_top1(partials, rows: int, logits_dtype, score_dtype):
  splits, _, experts = partials.shape
  layout = plgpu.Layout.WG_STRIDED((experts,), vec_size=1)

  def body(p_ref, idx_ref, score_ref):
    common.pdl_prologue()
    row = lax.axis_index("rows")
    acc = plgpu.layout_cast(p_ref[0, row], layout).astype(jnp.float32)
    for split in range(1, splits):
      acc = acc + plgpu.layout_cast(p_ref[split, row], layout).astype(jnp.float32)
    logits = acc.astype(logits_dtype).astype(jnp.float32)
    best = jnp.max(logits)
    index = plgpu.broadcasted_iota(jnp.int32, (experts,), 0, layout=layout).astype(jnp.float32)
    # Indices not holding the max move past the last expert; the min is the first argmax.
    index = index + (logits != best).astype(jnp.float32) * experts
    idx_ref[row] = jnp.min(index).astype(jnp.int32)
    score_ref[row] = (1.0 / (1.0 + jnp.exp(-best))).astype(score_dtype)

  out = (jax.ShapeDtypeStruct((rows,), jnp.int32), jax.ShapeDtypeStruct((rows,), score_dtype))
  return plgpu.kernel(body, out_type=out, grid=(rows,), grid_names=("rows",))(partials)
