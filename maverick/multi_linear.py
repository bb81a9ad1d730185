"""Several projections of one input in one kernel launch: q, k and v of attention, gate and up of
an MLP (`linear_many`, the many-weight form of `maverick.kernels.linear`).

At batch 1 a decode step is bound by its launch count, not its bytes: three GEMMs over the same
normed rows cost three launches (and XLA's three quantizations of x collapse into one only by
CSE). Here x is quantized once and `pallas_kernels.gemm.gemm_many` runs every weight's N tiles as
one work list, each product to its own output, so nothing is concatenated or sliced and the
weights stay as they are stored (q, k, v with their own shardings and FP8 scales).

The XLA path, and any call the kernel declines (static activation scales: each weight quantizes
x with its own scalar; mixed dtypes; a row-parallel product), returns None: the caller then runs
each projection on its own, the same math.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maverick import kernels as k_lib
from maverick.quant import ops as quant_ops
from pallas_kernels import gemm as gemm_lib
from pallas_kernels import selfcheck


def linear_many(spec: str, x: jax.Array, ws, scales, quant, kernels: str | None,
                placements=None, input_scales=None, out_dtype=None, partials: bool = False):
  """[einsum(spec, x, w) for w in ws] (each FP8 weight with its `scales` entry, `spec` in the
  stored layout as `linear` takes it) through one `gemm_many` launch, or None. `placements`:
  one (plan, logical axes) per weight on a sharded model (column-parallel products only).
  `partials`: each product as the GEMM leaves it for a kernel that finishes it
  (`gemm.gemm_many_partials`: [S, R >= rows, *output dims], S scaled split-K partials or S = 1
  the product; R the row tile, x's rows unsplit), split over the mesh like the output dims."""
  n_w = len(ws)
  input_scales = input_scales or (None,) * n_w
  if kernels == "xla" or n_w < 2:
    return None
  if any(k_lib._static(s, quant, si) for s, si in zip(scales, input_scales)):
    return None
  if len({s is None for s in scales}) != 1 or len({w.dtype for w in ws}) != 1:
    return None
  if placements is not None and placements[0] is not None:
    return _sharded(spec, x, ws, scales, quant, kernels, out_dtype, placements, partials)
  return _local(spec, x, ws, scales, quant, kernels, out_dtype, partials)


def _sharded(spec, x, ws, scales, quant, kernels, out_dtype, placements, partials=False):
  """Per shard, when every weight splits only its output axes (no partial sums) and x the same
  way for all of them."""
  plan = placements[0][0]
  specs = [k_lib.shard_specs(spec, x, plan, axes) for _, axes in placements]
  if any(s[4] for s in specs) or len({s[0] for s in specs}) != 1:
    return None
  if partials and specs[0][0][0] is not None:  # partials keep whole rows
    return None
  x_spec = specs[0][0]
  w_specs = tuple(s[1] for s in specs)
  scale_specs = tuple(s[2] for s in specs)
  out_specs = tuple(s[3] for s in specs)
  # The normed rows' FP8 form from the fused site before, whole on every device (rows unsplit).
  pre = None
  if quant is not None and x_spec[0] is None:
    pre = k_lib.quantized_rows(x, quant.activation_scale_ub)

  def local(x_, ws_, ss_, pre_):
    if pre_ is not None:
      k_lib.remember_quantized(x_, *pre_, quant.activation_scale_ub)
    return _local(spec, x_, ws_, ss_, quant, kernels, out_dtype, partials)

  if partials:  # [S, R, *output dims]: split as the output's weight dims are
    _, ws_letters, out = quant_ops._expand_ellipsis(spec, x.ndim)
    n_batch = len([c for c in out if c not in ws_letters])
    out_specs = tuple(P(None, None, *o[n_batch:]) for o in out_specs)
  out = k_lib._on_shards(plan, local, (x, tuple(ws), tuple(scales), pre),
                         (x_spec, w_specs, scale_specs, None if pre is None else (P(None, None),
                                                                                  P(None))),
                         out_specs)
  return None if out is None else list(out)


def _local(spec, x, ws, scales, quant, kernels, out_dtype, partials=False):
  shapes = [k_lib.gemm_shape(spec, x, w) for w in ws]
  if any(s is None for s in shapes) or len({(s[0], s[2], s[4]) for s in shapes}) != 1:
    return None
  layout, _, k, _, n_c = shapes[0]
  ns = [s[3] for s in shapes]
  quantize_x = scales[0] is not None and quant is not None and quant.quantize_activations
  x_dtype = quant_ops.FP8 if quantize_x else x.dtype
  batch = x.shape[:-n_c]
  rows = math.prod(batch)
  out_dtype = out_dtype or x.dtype
  ok, _ = gemm_lib.pallas_support_many(x_dtype, ws[0].dtype, ns, k, layout, m=rows,
                                       out_dtype=out_dtype)
  x2 = x.reshape(-1, k)
  w2s = tuple(w.reshape((k, n) if layout == "kn" else (n, k)) for w, n in zip(ws, ns))
  w_scales = tuple(None if s is None else s.reshape(n) for s, n in zip(scales, ns))

  def run(implementation, x2, w2s, w_scales, pre=None, raw=False):
    """pre: x's FP8 rows already made by the fused site before (k_lib.quantized_rows); raw:
    return `partials`' GEMM outputs as they are."""
    x_scale = None
    if quantize_x:
      tile = gemm_lib.row_tile(rows, ns[0], k, quant_ops.FP8, w2s[0].dtype, layout,
                               out_dtype=out_dtype)
      rows_out = rows + (-rows % tile)
      if pre is not None and pre[0].shape == (rows_out, k):
        x2, x_scale = pre
      else:
        x2, x_scale = k_lib._quantize_dynamic(x2, rows_out, quant.activation_scale_ub,
                                              implementation)
    many = gemm_lib.gemm_many_partials if partials else gemm_lib.gemm_many
    outs = many(x2, w2s, x_scale, None if w_scales[0] is None else w_scales, w_layout=layout,
                out_dtype=out_dtype, implementation=implementation)
    if raw:
      return outs
    if partials:  # the products as the finishing kernel sums them (what the probe compares)
      return tuple(jnp.sum(o.astype(jnp.float32), 0)[:rows].astype(out_dtype) for o in outs)
    return tuple(o[:rows] for o in outs)

  def make_args(rng):
    return (k_lib._normal(rng, x2.shape, x2.dtype),
            tuple(k_lib._normal(rng, w.shape, w.dtype, 1 / math.sqrt(k)) for w in w2s),
            tuple(None if s is None else k_lib._positive(rng, s.shape) for s in w_scales))

  def run_joined(implementation, *args):  # the probe compares one array
    return jnp.concatenate(run(implementation, *args), axis=-1)

  probe = selfcheck.Probe(
      "gemm_many", f"x {k_lib._sig(x2)} @ {len(w2s)} weights {k_lib._sig(*w2s)} "
      f"(w_layout={layout!r})",
      f"{k_lib._sig(x2, *w2s, *[s for s in w_scales if s is not None])} {layout} "
      f"quantize_x={quantize_x} {k_lib._activation_mode(quant, False)} "
      f"out={jnp.dtype(out_dtype).name} partials={partials}", make_args, run_joined,
      k_lib.PROBE_TOL)
  if not k_lib.use_pallas(kernels, ok, probe):
    return None
  pre = k_lib.quantized_rows(x, quant.activation_scale_ub) if quantize_x else None
  if partials:
    outs = run("pallas", x2, w2s, w_scales, pre, raw=True)
    return tuple(o.reshape(*o.shape[:2], *s[1]) for o, s in zip(outs, shapes))
  outs = run("pallas", x2, w2s, w_scales, pre)
  return tuple(o.reshape(*batch, *s[1]) for o, s in zip(outs, shapes))
