"""The XLA grouped GEMM: `jax.lax.ragged_dot_general` (weights (E, N, K), no transpose) with an f32 accumulator, scales in the epilogue.

Same semantics as the kernel: out[a] = (x[a] . w[g(a)]^T) * x_scale[a] * w_scale[g(a)] for the
rows a of group g(a) (rows sorted by group), rows past sum(group_sizes) are 0. FP8 weights met by
non-FP8 activations (weight-only quantization) are upcast to the activation dtype first, as
maverick.moe does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8 = jnp.float8_e4m3fn


def row_groups(group_sizes: jax.Array, num_rows: int) -> jax.Array:
  """int32 [A]: the group of each row; E for the rows past sum(group_sizes)."""
  ends = jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0))
  return jnp.searchsorted(ends, jnp.arange(num_rows, dtype=jnp.int32), side="right",
                          method="compare_all")  # no device while loop


# x [A, K] contracted with w [E, N, K] on K, groups along A and E.
_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


def ragged_dot_nk(x, w, group_sizes):
  """f32 [A, N]: XLA's ragged dot of x with K-major (E, N, K) weights."""
  return jax.lax.ragged_dot_general(x, w, group_sizes.astype(jnp.int32), _DIMS,
                                    preferred_element_type=jnp.float32)


def grouped_matmul(x, w, group_sizes, *, x_scale=None, w_scale=None, out_dtype=jnp.bfloat16):
  num_rows = x.shape[0]
  num_groups = w.shape[0]
  if w.dtype == FP8 and x.dtype != FP8:
    w = w.astype(x.dtype)
  acc = ragged_dot_nk(x, w, group_sizes)
  if x_scale is not None:
    acc = acc * x_scale.astype(jnp.float32)[:, None]
  if w_scale is not None:
    groups = row_groups(group_sizes, num_rows)
    valid = groups < num_groups
    col_scale = w_scale.astype(jnp.float32)[jnp.minimum(groups, num_groups - 1)]
    acc = jnp.where(valid[:, None], acc * col_scale, 0.0)
  return acc.astype(out_dtype)


def grouped_swiglu(x, w_gate, w_up, group_sizes, *, x_scale=None, gate_scale=None,
                   up_scale=None, out_dtype=jnp.bfloat16, matmul=None):
  """silu(gate) * up of the two scaled f32 products, cast once at the end. `matmul`: the product
  (default grouped_matmul: rows sorted by group; grouped_matmul_rows with row_groups)."""
  matmul = matmul or grouped_matmul
  gate = matmul(x, w_gate, group_sizes, x_scale=x_scale, w_scale=gate_scale,
                out_dtype=jnp.float32)
  up = matmul(x, w_up, group_sizes, x_scale=x_scale, w_scale=up_scale, out_dtype=jnp.float32)
  return (jax.nn.silu(gate) * up).astype(out_dtype)


def grouped_matmul_rows(x, w, row_groups, *, x_scale=None, w_scale=None, out_dtype=jnp.bfloat16):
  """Rows in any order, row a against w[row_groups[a]] (the per-row schedule's semantics): each
  row's expert weight gathered, so for a few rows (decode) only; a group outside [0, E), and x's
  rows past len(row_groups), give 0."""
  num_groups = w.shape[0]
  g = row_groups.astype(jnp.int32)
  g = jnp.pad(g, (0, x.shape[0] - g.shape[0]), constant_values=-1)  # padding rows: 0
  valid = (g >= 0) & (g < num_groups)
  g = jnp.clip(g, 0, num_groups - 1)
  if w.dtype == FP8 and x.dtype != FP8:
    w = w.astype(x.dtype)
  acc = jnp.einsum("ak,ank->an", x, w[g], preferred_element_type=jnp.float32)
  if x_scale is not None:
    acc = acc * x_scale.astype(jnp.float32)[:, None]
  if w_scale is not None:
    acc = acc * w_scale.astype(jnp.float32)[g]
  return jnp.where(valid[:, None], acc, 0.0).astype(out_dtype)
