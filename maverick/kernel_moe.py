"""The MoE on the kernel path: the routed experts through the grouped GEMM kernels, and Llama 4's
top-1 routing through the router GEMM and the routing kernel. Each helper returns None when the
caller should run its XLA path (see maverick.kernels: the switch, the self-check probes)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from maverick import kernels as k_lib
from maverick.quant import ops as quant_ops
from pallas_kernels import gemm as gemm_lib
from pallas_kernels import grouped_gemm
from pallas_kernels import moe_route
from pallas_kernels import quantize_rows
from pallas_kernels import selfcheck

# The MoE's per-row expert schedule (decode / verify) up to this many routed rows (rows x top-k):
# one tile a row, so a large batch would run many 64/128-row tiles for one row each.
ROW_PATH_MAX_ROWS = 64


def moe_experts(x_nd, top_idx, scores, gate_edf, up_edf, down_efd, kernels: str | None, *,
                scales=None, quant=None, input_scales=None, keep_row_padding: bool = False,
                shared=None):
  """Routed experts through the grouped GEMM kernels, or None: assignments sorted by expert,
  gate/up + SwiGLU fused in one kernel, down in another. BF16 experts are read in the declared
  (E, in, out) layout; FP8 ones (`scales` = (gate, up, down) per-channel scales, all three set) in
  the K-major layout they are stored in, each kernel's input rows quantized as the XLA path does:
  per token, or with the static scalars `input_scales` = (gate, up, down) of the
  "static_per_tensor" mode (weight-only FP8 has no kernel). The fused gate/up kernel quantizes
  its input once, with the gate's scalar: ModelOpt stores one `gate_up_proj_input_scale` for both
  (the only source of static scales; the loader gives gate and up that one value). Decode too:
  empty groups cost nothing, so there is no gather path. `keep_row_padding`: decode's rows come
  back as the down kernel writes them, [rows padded to its tile, D] (for the fused site).
  `shared` (`fused_mlp.shared_gate_up`'s (gate, up partials, rows, padded rows)): the shared
  expert's SwiGLU rows are quantized in the same launch as the routed down input
  (`quantize_rows.swiglu_and_quantize_rows`, behind its own self-check); returns (y, (its e4m3
  rows, scales)) then, or y alone where that launch is not taken."""
  if kernels == "xla":
    return None
  N, D = x_nd.shape
  k = top_idx.shape[-1]
  E = gate_edf.shape[0]
  fp8 = scales is not None
  F = gate_edf.shape[1] if fp8 else gate_edf.shape[2]
  layout = "enk" if fp8 else "ekn"
  in_dtype = quant_ops.FP8 if fp8 else x_nd.dtype
  rows = jax.ShapeDtypeStruct((N * k, D), in_dtype)
  hidden = jax.ShapeDtypeStruct((N * k, F), in_dtype)
  row_scale = jax.ShapeDtypeStruct((N * k,), jnp.float32) if fp8 else None
  static = fp8 and input_scales is not None and k_lib._static(scales[0], quant, input_scales[0])
  if fp8:
    ok = (all(s is not None for s in scales)
          and (static or (quant is not None and quant.quantize_activations))
          and gate_edf.dtype == up_edf.dtype == down_efd.dtype == quant_ops.FP8)
  else:
    ok = gate_edf.dtype == up_edf.dtype == down_efd.dtype == x_nd.dtype
  ok = (ok and grouped_gemm.pallas_support(rows, gate_edf, x_scale=row_scale,
                                           w_scale=scales and scales[0], w_layout=layout,
                                           swiglu=True, out_dtype=x_nd.dtype)[0]
        and grouped_gemm.pallas_support(hidden, down_efd, x_scale=row_scale,
                                        w_scale=scales and scales[2], w_layout=layout,
                                        out_dtype=x_nd.dtype)[0])
  s_gate, s_up, s_down = scales if fp8 else (None, None, None)
  si_gate, si_down = (input_scales[0], input_scales[2]) if static else (None, None)

  def rows_in(a, input_scale, rows_out, implementation):  # (kernel input, its per-row scale)
    a = jnp.pad(a, ((0, rows_out - a.shape[0]), (0, 0))) if static or not fp8 else a
    if not fp8:
      return a, None
    if static:
      return k_lib._quantize_static_rows(a, input_scale)
    return k_lib._quantize_dynamic(a, rows_out, quant.activation_scale_ub, implementation)

  # Decode and verify (a few rows): each row keeps its place with its own expert (the kernel's
  # per-row schedule), so no sort by expert, no gather and no scatter-add back: ~10 fewer
  # launches per MoE layer. Prefill sorts rows by expert: one tile per expert block.
  by_row = N * k <= min(ROW_PATH_MAX_ROWS, E + 1)
  # Top-1 FP8 rows per token without a cap: the SwiGLU kernel applies the router's score to its
  # products (`row_weights`), so x goes in unscaled: per-token quantization commutes with a
  # positive row factor, q(x * s) = q(x) with its scale times s, and the rows the fused site
  # before already quantized (the shared expert's input, `k_lib.quantized_rows`) serve as they are.
  # (A cap would clip x where it clips x * s.) Saves the score multiply's launch.
  weighted = (by_row and k == 1 and fp8 and not static
              and quant.activation_scale_ub is None)

  def run(implementation, x_rows, groups, gate, up, down, s_gate, s_up, s_down, si_gate,
          si_down, row_weights=None, pre=None, keep_row_padding=False, shared=None):
    """groups: per-row expert ids (by_row) or group sizes of rows sorted by expert. `pre`: the
    gate/up input already quantized (e4m3 rows, scales) with the kernel's row tile.
    `row_weights`: the scores the SwiGLU kernel applies (`weighted`)."""
    where = dict(row_groups=groups) if by_row else dict(group_sizes=groups)
    rows = rows_out = x_rows.shape[0]
    if by_row:
      # Padded to the kernel's row tile while quantizing (the pad fuses into the quantization;
      # the kernel stores the padding rows as zeros), and sliced back at the end.
      tile = grouped_gemm.row_tile(rows, gate, x_dtype=in_dtype, w_scale=s_gate,
                                   w_layout=layout, out_dtype=x_nd.dtype, swiglu=True)
      rows_out = rows + (-rows % tile)
    if pre is not None and pre[0].shape[0] == rows_out:
      xq, x_scale = pre
    else:
      xq, x_scale = rows_in(x_rows, si_gate, rows_out, implementation)
    h = grouped_gemm.grouped_swiglu(xq, gate, up, **where, x_scale=x_scale,
                                    gate_scale=s_gate, up_scale=s_up, w_layout=layout,
                                    out_dtype=x_nd.dtype, implementation=implementation,
                                    row_weights=row_weights)
    shared_rows = None
    if shared is not None:  # the shared expert's SwiGLU rows in the same launch
      g, u, m_s, rows_out_s = shared
      shared_rows_q, shared_s, hq, h_scale = quantize_rows.swiglu_and_quantize_rows(
          g, u, h, m=m_s, rows_out=rows_out_s, rows_out_x=h.shape[0],
          ub=quant.activation_scale_ub, implementation=implementation)
      shared_rows = (shared_rows_q, shared_s)
    else:
      hq, h_scale = rows_in(h, si_down, h.shape[0], implementation)
    out = grouped_gemm.grouped_matmul(hq, down, **where, x_scale=h_scale, w_scale=s_down,
                                      w_layout=layout, out_dtype=x_nd.dtype,
                                      implementation=implementation)
    out = out if keep_row_padding else out[:rows]
    return out if shared_rows is None else (out, shared_rows)

  def make_args(rng):
    if by_row:  # random experts per row, repeats and one past the last (another shard's)
      groups = rng.integers(0, E + 1, N * k).astype(np.int32)
    else:  # uneven groups with empty experts, as routing produces
      groups = rng.multinomial(N * k, rng.dirichlet(np.full(E, 0.3))).astype(np.int32)
    weights = [k_lib._normal(rng, w.shape, w.dtype, 1 / math.sqrt(fan_in))
               for w, fan_in in ((gate_edf, D), (up_edf, D), (down_efd, F))]
    w_scales = [None if s is None else k_lib._positive(rng, s.shape)
                for s in (s_gate, s_up, s_down)]
    statics = [k_lib._static_probe_scale(rng) if static else None for _ in range(2)]
    scores = k_lib._positive(rng, (N * k,)) / 2 if weighted else None
    return (k_lib._normal(rng, (N * k, D), x_nd.dtype), jnp.asarray(groups), *weights, *w_scales,
            *statics, scores)

  probe = selfcheck.Probe(
      "grouped_gemm (experts: SwiGLU, then down)",
      f"{N * k} rows x {k_lib._sig(gate_edf)} / {k_lib._sig(down_efd)} (w_layout={layout!r})",
      f"{N * k} rows {'by row ' if by_row else ''}"
      f"{k_lib._sig(x_nd, gate_edf, up_edf, down_efd, s_gate, s_up, s_down)} {layout} "
      f"{k_lib._activation_mode(quant, static)} weighted={weighted}", make_args, run,
      k_lib.PROBE_TOL)
  if not k_lib.use_pallas(kernels, ok, probe):
    return None
  if by_row:
    # The score scales the INPUT, as below (or, weighted, the kernel's products); top-k > 1
    # repeats each row once per pick.
    x_rows = x_nd if k == 1 else jnp.repeat(x_nd, k, axis=0)
    row_weights = pre = None
    if weighted:
      row_weights, pre = scores.reshape(-1), k_lib.quantized_rows(x_nd, None)
    else:
      x_rows = x_rows * scores.reshape(-1)[:, None]
    tile = grouped_gemm.row_tile(x_rows.shape[0], gate_edf, x_dtype=in_dtype, w_scale=s_gate,
                                 w_layout=layout, out_dtype=x_nd.dtype, swiglu=True)
    routed_rows = (x_rows.shape[0] + (-x_rows.shape[0] % tile), F)
    shared = shared if weighted and _takes_shared(shared, routed_rows, kernels, quant) else None
    y = run("pallas", x_rows, top_idx.reshape(-1).astype(jnp.int32), gate_edf, up_edf, down_efd,
            s_gate, s_up, s_down, si_gate, si_down, row_weights, pre, keep_row_padding and k == 1,
            shared)
    if k == 1:
      return y
    return y.astype(jnp.float32).reshape(N, k, D).sum(1).astype(x_nd.dtype)
  flat_expert = top_idx.reshape(-1)
  order = jnp.argsort(flat_expert, stable=True)
  token = order // k
  x_sorted = x_nd[token] * scores.reshape(-1)[order][:, None]  # the score scales the INPUT
  group_sizes = jnp.bincount(flat_expert, length=E).astype(jnp.int32)
  y = run("pallas", x_sorted, group_sizes, gate_edf, up_edf, down_efd, s_gate, s_up, s_down,
          si_gate, si_down)
  return jnp.zeros((N, D), jnp.float32).at[token].add(y).astype(x_nd.dtype)


def _takes_shared(shared, routed_rows, kernels, quant) -> bool:
  """Whether the routed down input (its SwiGLU rows: shape `routed_rows`) and the shared
  expert's SwiGLU rows (`shared`) are quantized in one launch: the kernel takes both shapes and
  (auto mode) passed its self-check."""
  if shared is None:
    return False
  g, u, m, rows_out = shared
  ub = quant.activation_scale_ub

  def run(implementation, g, u, h):  # the probe compares one array: every row, dequantized
    hq, hs, xq, xs = quantize_rows.swiglu_and_quantize_rows(
        g, u, h, m=m, rows_out=rows_out, rows_out_x=h.shape[0], ub=ub,
        implementation=implementation)
    deq = lambda q, s: (q.astype(jnp.float32) * s[:, None]).reshape(-1)
    return jnp.concatenate([deq(hq, hs), deq(xq, xs)])

  def make_args(rng):
    return (k_lib._normal(rng, g.shape, g.dtype), k_lib._normal(rng, u.shape, u.dtype),
            k_lib._normal(rng, routed_rows, jnp.bfloat16))

  probe = selfcheck.Probe(
      "swiglu_and_quantize_rows", f"shared gate/up {k_lib._sig(g)} with routed rows "
      f"{list(routed_rows)}", f"{k_lib._sig(g, u)} m={m} rows_out={rows_out} "
      f"routed={routed_rows} ub={ub}", make_args, run, k_lib.EPILOGUE_PROBE_TOL)
  ok = (quantize_rows.pallas_support(m, g.shape[2], rows_out, jnp.float32)[0]
        and quantize_rows.pallas_support(*routed_rows, routed_rows[0], jnp.bfloat16)[0])
  return k_lib.use_pallas(kernels, ok, probe)


def route_top1(x_nd, router_de, kernels: str | None):
  """Llama 4's top-1 routing (`maverick.moe.route` with k = 1 and a bf16 router [D, E]) as the
  router GEMM kernel and the routing kernel (`pallas_kernels.moe_route`), which sums the GEMM's
  K split itself: two launches where XLA takes three (the GEMV's two reductions, the routing
  reduction). (expert ids int32 [N, 1], scores [N, 1]) or None."""
  if kernels == "xla" or router_de.dtype != x_nd.dtype or x_nd.dtype == quant_ops.FP8:
    return None
  (n, d), e = x_nd.shape, router_de.shape[1]
  ok = (gemm_lib.pallas_support(x_nd.dtype, router_de.dtype, e, d, "kn", m=n,
                                out_dtype=jnp.float32)[0]
        and moe_route.pallas_support(n, e)[0])

  def run(implementation, x, router):
    logits = gemm_lib.gemm_many_partials(x, (router,), w_layout="kn", out_dtype=jnp.float32,
                                         implementation=implementation)[0]
    return moe_route.route_top1(logits, n, logits_dtype=x.dtype, score_dtype=x.dtype,
                                implementation=implementation)


  def one_hot(implementation, x, router):  # the probe compares one array: a wrong id is O(1)
    top, score = run(implementation, x, router)
    return jax.nn.one_hot(top[:, 0], e) * score.astype(jnp.float32)

  probe = selfcheck.Probe(
      "moe_route (router GEMM + top-1)", f"x {k_lib._sig(x_nd)} @ router {k_lib._sig(router_de)}",
      f"{k_lib._sig(x_nd, router_de)}",
      lambda rng: (k_lib._normal(rng, x_nd.shape, x_nd.dtype),
                   k_lib._normal(rng, router_de.shape, router_de.dtype, 1 / math.sqrt(d))),
      one_hot, k_lib.PROBE_TOL)
  if not k_lib.use_pallas(kernels, ok, probe):
    return None
  # The fused site's rows already padded to the GEMM's tile (zero rows): no pad launch.
  padded = k_lib.padded_rows(x_nd)
  tile = gemm_lib.row_tile(n, e, d, x_nd.dtype, router_de.dtype, "kn", out_dtype=jnp.float32)
  x = padded if padded is not None and padded.shape[0] % tile == 0 else x_nd
  return run("pallas", x, router_de)
