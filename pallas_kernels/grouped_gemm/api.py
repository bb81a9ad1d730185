"""MoE grouped GEMM: out[a] = x[a] @ w[group(a)]^T for rows sorted by group.

    grouped_matmul(x[A, K], w[E, N, K], group_sizes[E] int32, *, x_scale[A] | None,
                   w_scale[E, N] | None, out_dtype=bf16, implementation=None) -> [A, N]

Weights are stored K-major per expert, (E, N, K), as FP8 tensor cores want (maverick stores FP8
experts so; BF16 experts stay (E, D, F) = (E, K, N) and are read as stored with w_layout="ekn"). group_sizes is a device array
(traced: routing computes it), so it is made safe on device by both paths alike: each size is
clamped to [0, A] and groups are cut where the running total reaches A (a saturating sum that
cannot overflow int32); rows past the total are 0. Valid sizes (>= 0, sum <= A) are unchanged. Empty groups are
fine. FP8: e4m3 x and w with per-row activation scales x_scale and per-expert per-output-channel
weight scales w_scale, both applied to the f32 accumulator.

grouped_swiglu(x, w_gate[E, F, K], w_up[E, F, K], group_sizes, *, x_scale, gate_scale[E, F],
               up_scale[E, F], ...) -> silu(gate) * up [A, F]: the expert gate/up projections in
one kernel (two accumulators per x tile; neither [A, F] product is written to HBM).

Pallas kernels (sm_90: wgmma; sm_100: tcgen05 + TMEM; one shared persistent kernel, kernel.py):
bf16 x bf16 without scales, or e4m3 x e4m3 with both scales; K a multiple of 128 bytes of the
dtype (64 bf16 / 128 e4m3), N a multiple of 64, A while the tile schedule (kept in SMEM) fits
next to the pipeline: ~500k rows at E=128 (plan.py decides). Anything else the reference takes (e.g. bf16 x with e4m3 w: weight-only quantization)
runs on XLA under implementation=None; implementation="pallas" raises KernelInputError naming
why. Output is exact-product f32 accumulation: only the summation order differs from XLA.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels.grouped_gemm import reference, schedule, sm90, sm100
from pallas_kernels.grouped_gemm import plan as plan_lib

FP8 = jnp.float8_e4m3fn
_INPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                 jnp.dtype(FP8))
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def _groups_of(x, w, group_sizes, row_groups):
  """Checks that exactly one of group_sizes (rows sorted by group) / row_groups (each row's group,
  rows in any order) is given; returns the group_sizes to validate (a stand-in for row_groups)."""
  check = common.check
  check((group_sizes is None) != (row_groups is None),
        "pass group_sizes (rows sorted by group) or row_groups (each row's group), not both "
        "and not neither")
  if row_groups is None:
    return group_sizes
  num_rows, num_groups = x.shape[0], w.shape[0]
  check(row_groups.ndim == 1 and row_groups.shape[0] <= num_rows,
        f"row_groups: expected shape (A',) with A' <= {num_rows} (a group for each of the first "
        f"A' rows of x {x.shape}; the rest are padding, stored as 0), got {row_groups.shape}")
  check(jnp.issubdtype(row_groups.dtype, jnp.integer),
        f"row_groups: expected an integer dtype (int32), got {row_groups.dtype}")
  check(row_groups.shape[0] <= num_groups + 1,
        f"row_groups: {row_groups.shape[0]} rows over {num_groups} groups; the per-row schedule "
        f"(one tile a row) takes at most E + 1 rows: sort rows by group and pass group_sizes")
  return jax.ShapeDtypeStruct((num_groups,), jnp.int32)


def _validate(x, w, group_sizes, x_scale, w_scale, out_dtype):
  check = common.check
  check(x.ndim == 2, f"x: expected [A, K], got shape {x.shape}")
  check(w.ndim == 3, f"w: expected [E, N, K] (K-major per expert), got shape {w.shape}")
  num_rows, k = x.shape
  num_groups, n, wk = w.shape
  check(wk == k, f"w: shape {w.shape} has K={wk} but x {x.shape} has K={k}; weights are "
        f"(E, N, K): swap the last two axes of an (E, K, N) array")
  check(x.dtype in _INPUT_DTYPES, f"x: dtype {x.dtype} not supported; use one of "
        f"{[str(d) for d in _INPUT_DTYPES]}")
  check(w.dtype in _INPUT_DTYPES, f"w: dtype {w.dtype} not supported; use one of "
        f"{[str(d) for d in _INPUT_DTYPES]}")
  weight_only = w.dtype == FP8 and x.dtype != FP8
  check(x.dtype == w.dtype or weight_only,
        f"x dtype {x.dtype} and w dtype {w.dtype} differ; cast them to one dtype (only FP8 "
        f"weights may meet non-FP8 activations, as weight-only quantization)")
  check(group_sizes.shape == (num_groups,),
        f"group_sizes: expected shape ({num_groups},) (one per expert of w {w.shape}), got "
        f"{group_sizes.shape}")
  check(jnp.issubdtype(group_sizes.dtype, jnp.integer),
        f"group_sizes: expected an integer dtype (int32), got {group_sizes.dtype}")
  if x_scale is not None:
    check(x_scale.shape == (num_rows,),
          f"x_scale: expected shape ({num_rows},) (one per row of x {x.shape}), got "
          f"{x_scale.shape}")
  if w_scale is not None:
    check(w_scale.shape == (num_groups, n),
          f"w_scale: expected shape ({num_groups}, {n}) (per expert, per output channel of w "
          f"{w.shape}), got {w_scale.shape}")
  check(jnp.dtype(out_dtype) in _OUT_DTYPES,
        f"out_dtype: {out_dtype} not supported; use bfloat16 or float32")


def row_tile(num_rows: int, w, *, x_dtype, w_scale=None, w_layout: str = "enk",
             out_dtype=jnp.bfloat16, swiglu: bool = False, arch: str | None = None) -> int:
  """The rows the kernel pads x to a multiple of (1 when it does not take the call): a caller
  that pads (and passes row_groups for its real rows) before quantizing x makes the padding in
  the quantization's own launches."""
  view = _k_major_view(w, w_layout)
  scaled = w_scale is not None
  p = plan_lib.plan(num_rows, view.shape[0], view.shape[1], view.shape[2], x_dtype, view.dtype,
                    scaled=scaled, num_weights=2 if swiglu else 1, out_dtype=out_dtype,
                    w_layout=w_layout, arch=arch)
  return p.config.tile_m if p.supported else 1


def _plan(x, w_enk, x_scale, w_scale, out_dtype, num_weights, w_layout, arch=None):
  """The planner's answer (plan.plan) for these inputs; w_enk: w's (E, N, K) view."""
  scaled = x_scale is not None and w_scale is not None  # one scale alone: unsupported dtypes
  return plan_lib.plan(x.shape[0], w_enk.shape[0], w_enk.shape[1], x.shape[1], x.dtype,
                       w_enk.dtype, scaled=scaled, num_weights=num_weights, out_dtype=out_dtype,
                       w_layout=w_layout, arch=arch)


def _k_major_view(w, w_layout):
  """w as the (E, N, K) shape/dtype the checks speak of; w_layout "ekn" stores it (E, K, N)."""
  common.check(w_layout in ("enk", "ekn"),
               f"w_layout={w_layout!r}; use 'enk' (K-major, the default) or 'ekn'")
  if w_layout == "enk" or w.ndim != 3:
    return w
  return jax.ShapeDtypeStruct((w.shape[0], w.shape[2], w.shape[1]), w.dtype)


def _as_enk(w, w_layout):
  return jnp.swapaxes(w, 1, 2) if w_layout == "ekn" else w


def pallas_support(x, w, *, x_scale=None, w_scale=None, w_layout: str = "enk",
                   out_dtype=jnp.bfloat16, swiglu: bool = False, arch: str | None = None
                   ) -> tuple[bool, str]:
  """(supported, why not) for the Pallas kernel on these inputs (arrays or ShapeDtypeStructs):
  the planner's answer, so a supported call lowers. `swiglu`: for grouped_swiglu (w is the gate,
  the up weight has its shape: two accumulators and weight pipelines). `arch`: default the one a
  kernel would run on."""
  p = _plan(x, _k_major_view(w, w_layout), x_scale, w_scale, out_dtype, 2 if swiglu else 1,
            w_layout, arch)
  return p.supported, p.why


_STATIC = ("out_dtype", "w_kn", "cfg")
_KERNELS = {arch: (common.lowered_once(m.grouped_matmul, _STATIC),
                   common.lowered_once(m.grouped_swiglu, _STATIC))
            for arch, m in (("sm90", sm90), ("sm100", sm100))}


def _arch_kernels():
  """(grouped_matmul, grouped_swiglu) of the target architecture."""
  return _KERNELS[common.target_arch()]


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array | None = None, *,
                   x_scale: jax.Array | None = None, w_scale: jax.Array | None = None,
                   out_dtype=jnp.bfloat16, w_layout: str = "enk",
                   implementation: str | None = None,
                   row_groups: jax.Array | None = None) -> jax.Array:
  """[A, N] = per-group x @ w[g]^T, scaled by x_scale[a] * w_scale[g, n]; see the module doc.
  w_layout="ekn": bf16 w stored (E, K, N) (computing x @ w[g]), read as stored by the kernel.
  `row_groups` [A' <= A] instead of group_sizes: the group of each of x's first A' rows, in any
  order (a few rows: decode); a group outside [0, E), and rows past A' (x padded by the caller
  to `row_tile`), give zero rows."""
  view = _k_major_view(w, w_layout)
  _validate(x, view, _groups_of(x, view, group_sizes, row_groups), x_scale, w_scale, out_dtype)
  if row_groups is None:
    group_sizes = schedule.safe_group_sizes(group_sizes, x.shape[0])
  plan = _plan(x, view, x_scale, w_scale, out_dtype, 1, w_layout, common.runnable_arch())
  impl = common.resolve(implementation, supported=plan.supported, why=plan.why)
  if impl == "xla" or x.shape[0] == 0:  # no rows: nothing for a kernel to schedule
    if row_groups is not None:
      return reference.grouped_matmul_rows(x, _as_enk(w, w_layout), row_groups, x_scale=x_scale,
                                           w_scale=w_scale, out_dtype=out_dtype)
    return reference.grouped_matmul(x, _as_enk(w, w_layout), group_sizes, x_scale=x_scale,
                                    w_scale=w_scale, out_dtype=out_dtype)
  f32 = lambda a: None if a is None else a.astype(jnp.float32)
  i32 = lambda a: None if a is None else a.astype(jnp.int32)
  return _arch_kernels()[0](x, w, i32(group_sizes), f32(x_scale), f32(w_scale),
                            out_dtype=jnp.dtype(out_dtype), w_kn=w_layout == "ekn",
                            cfg=plan.config, row_groups=i32(row_groups))


def grouped_swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   group_sizes: jax.Array | None = None, *,
                   x_scale: jax.Array | None = None, gate_scale: jax.Array | None = None,
                   up_scale: jax.Array | None = None, out_dtype=jnp.bfloat16,
                   w_layout: str = "enk", implementation: str | None = None,
                   row_groups: jax.Array | None = None,
                   row_weights: jax.Array | None = None) -> jax.Array:
  """[A, F] = silu(x @ w_gate[g]^T * scales) * (x @ w_up[g]^T * scales); see the module doc.
  `row_groups`: as in grouped_matmul. `row_weights` [A'] (with row_groups): each routed row's
  products also times its weight, before the SwiGLU: the MoE router's score, as if it scaled the
  input row (the kernel applies it; nothing multiplies x or its scales first)."""
  gate_view, up_view = _k_major_view(w_gate, w_layout), _k_major_view(w_up, w_layout)
  sizes_or_stand_in = _groups_of(x, gate_view, group_sizes, row_groups)
  _validate(x, gate_view, sizes_or_stand_in, x_scale, gate_scale, out_dtype)
  common.check(w_up.shape == w_gate.shape and w_up.dtype == w_gate.dtype,
               f"w_up: {w_up.shape} {w_up.dtype} must match w_gate {w_gate.shape} "
               f"{w_gate.dtype}")
  common.check((gate_scale is None) == (up_scale is None),
               "gate_scale and up_scale: pass both (FP8 experts) or neither")
  _validate(x, up_view, sizes_or_stand_in, x_scale, up_scale, out_dtype)
  if row_weights is not None:
    common.check(row_groups is not None and row_weights.shape == row_groups.shape
                 and jnp.issubdtype(row_weights.dtype, jnp.floating),
                 f"row_weights: {row_weights.shape} {row_weights.dtype}; pass float weights of "
                 f"row_groups' shape {None if row_groups is None else row_groups.shape}, with "
                 "row_groups")
  if row_groups is None:
    group_sizes = schedule.safe_group_sizes(group_sizes, x.shape[0])
  plan = _plan(x, gate_view, x_scale, gate_scale, out_dtype, 2, w_layout, common.runnable_arch())
  impl = common.resolve(implementation, supported=plan.supported, why=plan.why)
  if impl == "xla" or x.shape[0] == 0:
    args = (x, _as_enk(w_gate, w_layout), _as_enk(w_up, w_layout))
    kw = dict(x_scale=x_scale, gate_scale=gate_scale, up_scale=up_scale, out_dtype=out_dtype)
    if row_groups is not None:
      if row_weights is not None:  # as the input row scaled: its products' row scale
        rows_scale = jnp.ones((x.shape[0],), jnp.float32) if x_scale is None else x_scale
        kw["x_scale"] = rows_scale.astype(jnp.float32).at[:row_weights.shape[0]].multiply(
            row_weights.astype(jnp.float32))
      return reference.grouped_swiglu(*args, row_groups, **kw,
                                      matmul=reference.grouped_matmul_rows)
    return reference.grouped_swiglu(*args, group_sizes, **kw)
  f32 = lambda a: None if a is None else a.astype(jnp.float32)
  i32 = lambda a: None if a is None else a.astype(jnp.int32)
  return _arch_kernels()[1](x, w_gate, w_up, i32(group_sizes), f32(x_scale),
                            f32(gate_scale), f32(up_scale), out_dtype=jnp.dtype(out_dtype),
                            w_kn=w_layout == "ekn", cfg=plan.config, row_groups=i32(row_groups),
                            row_weights=row_weights)
