"""An FP8 SwiGLU MLP on the kernel path in three launches: gate + up in one GEMM, the SwiGLU and
the down projection's per-token FP8 quantization in one kernel that reads the GEMM's split-K
partials as they are, then down (dense layers: with the fused all-reduce + residual + norm).

The einsum path takes five: the same GEMMs, plus XLA's SwiGLU fusion (which the split-K sum and
scales ride in) and the quantize kernel after it. On a sharded model the three run in ONE
shard_map (gate / up column-parallel, down row-parallel): the SwiGLU's input never leaves the
device, so nothing but the final all-reduce crosses it.

Calls the kernels do not take (bf16 or weight-only FP8 weights, static activation scales,
shapes the planners decline) return None: the caller runs `maverick.moe.swiglu`'s einsum path,
which is also the self-check's reference through each op's XLA implementation.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maverick import kernels as k_lib
from maverick.quant import ops as quant_ops
from pallas_kernels import gemm as gemm_lib
from pallas_kernels import quantize_rows as quantize_lib
from pallas_kernels import selfcheck

FP8 = quant_ops.FP8
# The self-check's bound (max |kernel - XLA| / max |XLA| of the MLP's output): both paths
# re-quantize silu(g) * u, whose bf16 values differ by a rounding step here and there, so an
# e4m3 code flips (2^-4 of its term) where XLA's GEMMs flip another: measured 0.025 on an
# interpreted probe (PROBE_TOL's 0.02 for bf16 outputs failed it). A wrong split, scale or
# gate / up order is off by 0.3 or more.
PROBE_TOL = 0.1
# Stored (K-major) specs of the three projections: gate / up [F, D], down [D, F].
UP_SPEC, DOWN_SPEC = "...d,fd->...f", "...f,df->...d"


def takes(scales, quant, input_scales) -> bool:
  """Whether the three projections are FP8 with per-token dynamic activations (the mode the
  kernels here quantize in)."""
  return (all(s is not None for s in scales) and quant is not None
          and quant.quantize_activations and not quant.static_activations
          and all(s is None for s in input_scales))


def swiglu(x, gate, up, down, scales, quant, kernels: str | None, placements=(None,) * 3,
           input_scales=(None,) * 3, fuse: k_lib.Fuse | None = None):
  """down(silu(x @ gate) * (x @ up)) as `maverick.moe.swiglu` computes it, FP8 weights stored
  K-major (gate / up [F, D], down [D, F]) with per-channel `scales`, or None. `placements`: one
  (plan, stored logical axes) per weight on a sharded model; `fuse`: the down projection's
  all-reduce fused with the residual add and norm (returns (new residual, normed))."""
  if kernels == "xla" or not takes(scales, quant, input_scales):
    return None
  if placements[0] is None:
    return _local(x, gate, up, down, *scales, quant=quant, kernels=kernels)
  return _sharded(x, (gate, up, down), scales, quant, kernels, placements, fuse)


def _sharded(x, weights, scales, quant, kernels, placements, fuse):
  plan = placements[0][0]
  up_specs = [k_lib.shard_specs(UP_SPEC, x, plan, axes) for _, axes in placements[:2]]
  h = jax.ShapeDtypeStruct((*x.shape[:-1], weights[0].shape[0]), x.dtype)
  x_spec = up_specs[0][0]
  h_spec, dw_spec, ds_spec, out_spec, reduce_axes = k_lib.shard_specs(DOWN_SPEC, h, plan,
                                                                      placements[2][1])
  # gate / up split only their outputs, both alike, and down contracts exactly that split.
  if (up_specs[0][4] or up_specs[1][4] or up_specs[0][1:4] != up_specs[1][1:4]
      or tuple(h_spec) != tuple(up_specs[0][3])):
    return None
  ub = quant.activation_scale_ub
  pre = k_lib.quantized_rows(x, ub) if x_spec[0] is None else None
  keep_padding = fuse is not None and bool(reduce_axes)

  def local(x_, g_, u_, d_, sg_, su_, sd_, pre_):
    if pre_ is not None:
      k_lib.remember_quantized(x_, *pre_, ub)
    return _local(x_, g_, u_, d_, sg_, su_, sd_, quant=quant, kernels=kernels,
                  keep_row_padding=keep_padding)

  args = (x, *weights, *scales, pre)
  in_specs = (x_spec, up_specs[0][1], up_specs[1][1], dw_spec, up_specs[0][2], up_specs[1][2],
              ds_spec, None if pre is None else (P(None, None), P(None)))
  structs = jax.tree.map(lambda s, a: k_lib._local_struct(a, s, plan.mesh), in_specs, args,
                         is_leaf=lambda s: isinstance(s, P))
  with selfcheck.on_mesh(plan.mesh):
    if jax.eval_shape(local, *structs) is None:
      return None
  return k_lib._on_shards(plan, local, args, in_specs, out_spec, reduce_axes,
                          fuse if reduce_axes else None)


def _local(x, gate, up, down, s_gate, s_up, s_down, *, quant, kernels,
           keep_row_padding: bool = False, gate_up_only: bool = False):
  """The three launches on one device's shards, or None where a kernel declines them.
  `gate_up_only`: only the first, for `shared_gate_up`."""
  batch, d = x.shape[:-1], x.shape[-1]
  rows, f = math.prod(batch), gate.shape[0]
  if up.shape != gate.shape or down.shape != (d, f):
    return None
  ub = quant.activation_scale_ub
  tile = lambda n, k: gemm_lib.row_tile(rows, n, k, FP8, FP8)
  rows_up, rows_down = rows + (-rows % tile(f, d)), rows + (-rows % tile(d, f))
  ok = (gemm_lib.pallas_support_many(FP8, FP8, (f, f), d, m=rows)[0]
        and gemm_lib.pallas_support(FP8, FP8, d, f, m=rows)[0]
        and quantize_lib.pallas_support(rows, f, rows_down, jnp.float32)[0])
  x2 = x.reshape(rows, d)

  def run(implementation, x2, gate, up, down, s_gate, s_up, s_down, pre=None,
          keep_row_padding=False):  # the self-check compares the finished [rows, D] products
    if pre is not None and pre[0].shape == (rows_up, d):
      xq, xs = pre
    else:
      xq, xs = k_lib._quantize_dynamic(x2, rows_up, ub, implementation)
    g, u = gemm_lib.gemm_many_partials(xq, (gate, up), xs, (s_gate, s_up),
                                       implementation=implementation)
    hq, hs = quantize_lib.swiglu_quantize_rows(g, u, m=rows, rows_out=rows_down, ub=ub,
                                               implementation=implementation)
    if keep_row_padding:  # the fused site sums the K split's partials (see kernels.linear)
      return gemm_lib.gemm_many_partials(hq, (down,), hs, (s_down,), out_dtype=x2.dtype,
                                         implementation=implementation)[0]
    return gemm_lib.gemm(hq, down, hs, s_down, out_dtype=x2.dtype,
                         implementation=implementation)[:rows]

  def make_args(rng):
    return (k_lib._normal(rng, x2.shape, x2.dtype),
            k_lib._normal(rng, gate.shape, gate.dtype, 1 / math.sqrt(d)),
            k_lib._normal(rng, up.shape, up.dtype, 1 / math.sqrt(d)),
            k_lib._normal(rng, down.shape, down.dtype, 1 / math.sqrt(f)),
            *(k_lib._positive(rng, s.shape) for s in (s_gate, s_up, s_down)))

  probe = selfcheck.Probe(
      "swiglu_mlp", f"x {k_lib._sig(x2)} through gate / up {k_lib._sig(gate)} and down "
      f"{k_lib._sig(down)}",
      f"{k_lib._sig(x2, gate, up, down, s_gate, s_up, s_down)} "
      f"{k_lib._activation_mode(quant, False)}", make_args, run, PROBE_TOL)
  if not k_lib.use_pallas(kernels, ok, probe):
    return None
  if gate_up_only:
    pre = k_lib.quantized_rows(x, ub)
    xq, xs = (pre if pre is not None and pre[0].shape == (rows_up, d)
              else k_lib._quantize_dynamic(x2, rows_up, ub, "pallas"))
    g, u = gemm_lib.gemm_many_partials(xq, (gate, up), xs, (s_gate, s_up),
                                       implementation="pallas")
    return g, u, rows, rows_down
  y = run("pallas", x2, gate, up, down, s_gate, s_up, s_down, k_lib.quantized_rows(x, ub),
          keep_row_padding)
  return y if keep_row_padding else y.reshape(*batch, d)


def local_partials(x, gate, up, down, s_gate, s_up, s_down, *, quant, kernels):
  """Inside a shard_map (the sharded MoE's): the MLP's down product as a fused site takes it,
  [S, R >= rows, D] (K-split partials, each scaled), or None where the kernels decline."""
  if kernels == "xla" or not takes((s_gate, s_up, s_down), quant, (None,) * 3):
    return None
  return _local(x, gate, up, down, s_gate, s_up, s_down, quant=quant, kernels=kernels,
                keep_row_padding=True)


def shared_gate_up(x, gate, up, down, s_gate, s_up, s_down, *, quant, kernels):
  """Inside the sharded MoE's shard_map: the shared expert's gate / up GEMM outputs for a kernel
  that makes its SwiGLU rows together with the routed experts' down input
  (`kernel_moe.moe_experts(shared=)`): (gate, up partials, rows, padded rows), or None where the
  kernels decline (`local_partials` then runs the MLP whole). Its down: `shared_down`."""
  if kernels == "xla" or not takes((s_gate, s_up, s_down), quant, (None,) * 3):
    return None
  return _local(x, gate, up, down, s_gate, s_up, s_down, quant=quant, kernels=kernels,
                gate_up_only=True)


def shared_down(hq, hs, down, s_down, out_dtype):
  """The shared expert's down product from its FP8 SwiGLU rows, as a fused site takes it
  ([S, R, D] K-split partials, each scaled)."""
  return gemm_lib.gemm_many_partials(hq, (down,), hs, (s_down,), out_dtype=out_dtype,
                                     implementation="pallas")[0]
