"""Sparse mixture-of-experts dispatch: routing, the experts (XLA path, or the Pallas grouped GEMM
through maverick.kernels), the SwiGLU FFN, and the sharded MoE (`sharded_moe`, inside shard_map on
a model carrying a sharding plan).

Only the selected experts' work is computed: token assignments are sorted by expert, each expert's rows
are cut into tiles of `tile_m` rows, and one matmul runs per non-empty tile against that expert's weight.
An expert no token chose is never touched, not even multiplied by zero (a test plants NaN in one to
check). `jax.lax.ragged_dot` is kept as an alternative: it lowers to a native grouped GEMM on GPU/TPU,
but on CPU JAX lowers it to a dense product over every expert.

Glossary: N tokens, A = N*k assignments, E experts, D model, F expert width.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from maverick import fused_mlp
from maverick import kernel_moe
from maverick import kernels as kernels_lib
from maverick.quant import contraction
from maverick.quant import ops as quant_lib
from maverick.sharding_plan import Plan

MOE_IMPLS = ("tiles", "ragged_dot")


def route(x_nd: jax.Array, router_de: jax.Array, k: int, *, router_scale=None, quant=None,
          router_input_scale=None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Llama 4 routing: top-k of the RAW router logits, sigmoid score (no softmax, no renorm).
  Returns (expert ids [N, k], scores [N, k], router logits [N, E]). `router_scale` [E]: the router
  is FP8 (see maverick.quant.einsum)."""
  logits = contraction.einsum("nd,de->ne", x_nd, router_de, router_scale, quant,
                              input_scale=router_input_scale)
  if k == 1:  # Llama 4's top-1: a max and an argmax (one reduction; top_k sorts on a GPU)
    top_idx = jnp.argmax(logits, axis=-1, keepdims=True).astype(jnp.int32)
    # The score as the max of the sigmoids (monotonic: the same value as the sigmoid of the max
    # logit): the sigmoid then rides in the reduction's input, where a gather at the argmax, or
    # a sigmoid after the max, was a launch of its own.
    scores = jnp.max(jax.nn.sigmoid(logits.astype(jnp.float32)), axis=-1, keepdims=True)
    return top_idx, scores.astype(x_nd.dtype), logits
  top_logits, top_idx = jax.lax.top_k(logits, k)
  scores = jax.nn.sigmoid(top_logits.astype(jnp.float32)).astype(x_nd.dtype)
  return top_idx, scores, logits


def load_balancing_loss(router_logits: jax.Array, top_idx: jax.Array) -> jax.Array:
  """Switch-Transformer auxiliary loss E * sum_e f_e * P_e (1 when perfectly balanced): f_e the
  fraction of assignments to expert e, P_e its mean softmax router probability. Training only."""
  E = router_logits.shape[-1]
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  frac = jnp.mean(jax.nn.one_hot(top_idx, E, dtype=jnp.float32), axis=(0, 1))
  return E * jnp.sum(frac * jnp.mean(probs, axis=0))


def default_tile_m(num_rows: int, num_groups: int) -> int:
  avg = max(1, math.ceil(num_rows / num_groups))
  return int(min(128, max(8, 1 << (avg - 1).bit_length())))


def grouped_matmul(x_ad: jax.Array, w_edf: jax.Array, group_sizes: jax.Array, *,
                   tile_m: int | None = None, impl: str = "tiles", kmajor: bool = False
                   ) -> jax.Array:
  """out[a] = x[a] @ w[group(a)] for rows sorted by group; group_sizes [E] sums to A.
  kmajor: w is stored [E, F, D] (FP8 experts are), and out[a] = x[a] @ w[group(a)].T.

  Returns float32 [A, F] (accumulation dtype); empty groups are allowed.
  """
  A, D = x_ad.shape
  E = w_edf.shape[0]
  F = w_edf.shape[1] if kmajor else w_edf.shape[2]
  w_dim_d = 2 if kmajor else 1
  if impl == "ragged_dot":
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (w_dim_d,)), ((), ())), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(x_ad, _operand(w_edf, x_ad.dtype), group_sizes, dims,
                                      preferred_element_type=jnp.float32)
  if impl != "tiles":
    raise ValueError(f"unknown MoE implementation {impl!r}; choose one of {MOE_IMPLS}")
  tm = tile_m or default_tile_m(A, E)
  # Every group wastes less than one tile, and at most min(E, A) groups are non-empty.
  max_tiles = math.ceil(A / tm) + min(E, A)
  tiles_per_group = (group_sizes + tm - 1) // tm
  tile_end = jnp.cumsum(tiles_per_group)
  group_start = jnp.cumsum(group_sizes) - group_sizes
  t = jnp.arange(max_tiles)
  tile_group = jnp.minimum(jnp.searchsorted(tile_end, t, side="right", method="compare_all"),
                           E - 1)  # no device while loop
  first_tile = (tile_end - tiles_per_group)[tile_group]
  row_start = group_start[tile_group] + (t - first_tile) * tm
  row_end = (group_start + group_sizes)[tile_group]

  last_tile = tile_end[-1]
  x_pad = jnp.concatenate([x_ad, jnp.zeros((tm, D), x_ad.dtype)])

  # No slice at the loop index (XLA:GPU runs those as async copies, which keep the loop out of a
  # CUDA graph): the tile's scalars are picked by a compare-and-sum, its rows gathered, and its
  # output scattered into the carry (each row written once, so the sums are exact).
  def one_tile(i, out):
    pick = lambda a: jnp.sum(jnp.where(t == i, a, 0))
    group, start, end = pick(tile_group), pick(row_start), pick(row_end)
    is_active = i < last_tile
    rows = start + jnp.arange(tm)
    x_md = x_pad[jnp.minimum(rows, A + tm - 1)]
    y = jax.lax.cond(
        is_active,
        lambda: jax.lax.dot_general(x_md, _operand(w_edf[group], x_md.dtype),
                                    (((1,), (w_dim_d - 1,)), ((), ())),
                                    preferred_element_type=jnp.float32),
        lambda: jnp.zeros((tm, F), jnp.float32))
    dest = jnp.where((rows < end) & is_active, rows, A)  # padding rows go to a dump row
    return out.at[dest].add(y)

  out = jax.lax.fori_loop(0, max_tiles, one_tile, jnp.zeros((A + 1, F), jnp.float32))
  return out[:A]


def _operand(w, x_dtype):
  """FP8 weights meet bf16 activations (weight-only quantization) upcast, inside the tile."""
  return w.astype(x_dtype) if w.dtype == quant_lib.FP8 and x_dtype != quant_lib.FP8 else w


def _gathered_experts(x_nd, top_idx, scores, gate_edf, up_edf, down_efd):
  """Few tokens (decode, verify): gather each assignment's expert weights and run batched
  matrix-vector products; no sorting and no loop, still only the chosen experts."""
  N, D = x_nd.shape
  z = (x_nd[:, None, :] * scores[..., None]).reshape(-1, D)  # [A, D]
  e = top_idx.reshape(-1)
  mm = lambda a, w, spec: jnp.einsum(spec, a, w[e], preferred_element_type=jnp.float32)
  h = jax.nn.silu(mm(z, gate_edf, "ad,adf->af")) * mm(z, up_edf, "ad,adf->af")
  y = mm(h.astype(x_nd.dtype), down_efd, "af,afd->ad")
  return y.reshape(N, -1, D).sum(axis=1).astype(x_nd.dtype)


def moe_experts(x_nd: jax.Array, top_idx: jax.Array, scores: jax.Array, gate_edf: jax.Array,
                up_edf: jax.Array, down_efd: jax.Array, *, impl: str = "tiles", scales=None,
                quant=None, kernels: str | None = "xla", input_scales=None,
                keep_row_padding: bool = False, shared=None) -> jax.Array:
  """Sum over the k chosen experts of Expert_e(score * x) (the score scales the expert INPUT).

  The weights are named by their declared layout (gate/up [E,D,F], down [E,F,D]); an FP8 one is
  stored K-major (gate/up [E,F,D], down [E,D,F]; see maverick.quant.to_kmajor). scales: (gate
  [E,F], up [E,F], down [E,D]) per-expert per-output-channel scales of FP8 expert weights (None
  entries: that weight is unquantized); `quant` says whether activations are quantized per token.
  input_scales: (gate, up, down) static activation scales (f32 scalars shared by all experts) when
  `quant.activations` is "static_per_tensor"; the grouped GEMM kernels take that mode too.

  With at most one assignment per expert on average (decode and verification steps) the chosen
  weights are gathered; otherwise tokens are sorted by expert for a grouped matmul (`impl`).
  `kernels` (see maverick.kernels): the Pallas grouped GEMM kernels, BF16 or FP8 experts.
  `keep_row_padding`: the kernels' [R >= N, D] rows may come back unsliced (for the fused site).
  `shared`: see kernel_moe.moe_experts (the result may then be (y, the shared SwiGLU rows))."""
  N, D = x_nd.shape
  k = top_idx.shape[-1]
  E = gate_edf.shape[0]
  quantized = scales is not None and any(s is not None for s in scales)
  static = quantized and quant is not None and quant.static_activations
  if kernels != "xla":
    y = kernel_moe.moe_experts(x_nd, top_idx, scores, gate_edf, up_edf, down_efd, kernels,
                                scales=scales if quantized else None, quant=quant,
                                input_scales=input_scales if static else None,
                                keep_row_padding=keep_row_padding, shared=shared)
    if y is not None:
      return y
  if quantized:
    return _fp8_experts(x_nd, top_idx, scores, (gate_edf, up_edf, down_efd), scales, quant,
                        impl=impl, input_scales=input_scales if static else (None,) * 3)
  if impl == "tiles" and N * k <= E:
    return _gathered_experts(x_nd, top_idx, scores, gate_edf, up_edf, down_efd)
  flat_expert = top_idx.reshape(-1)
  order = jnp.argsort(flat_expert, stable=True)
  token = order // k
  x_sorted = x_nd[token] * scores.reshape(-1)[order][:, None]
  group_sizes = jnp.bincount(flat_expert, length=E).astype(jnp.int32)
  mm = lambda a, w: grouped_matmul(a, w, group_sizes, impl=impl)
  gate = mm(x_sorted, gate_edf)
  up = mm(x_sorted, up_edf)
  h = (jax.nn.silu(gate) * up).astype(x_nd.dtype)
  y = mm(h, down_efd).astype(x_nd.dtype)
  return jnp.zeros((N, D), jnp.float32).at[token].add(y).astype(x_nd.dtype)


def _fp8_experts(x_nd, top_idx, scores, weights, scales, quant, *, impl,
                 input_scales=(None, None, None)):
  """The two dispatch paths of `moe_experts` with FP8 expert weights: each assignment's input row
  is quantized per token (when `quant` says so), the grouped/gathered product runs FP8 x FP8 with
  f32 accumulation, and the row and expert-channel scales are applied to the accumulator."""
  N, D = x_nd.shape
  k = top_idx.shape[-1]
  E = weights[0].shape[0]
  z = (x_nd[:, None, :] * scores[..., None]).reshape(-1, D)  # [A, D] score-scaled inputs
  e = top_idx.reshape(-1)
  if impl == "tiles" and N * k <= E:
    def mm(a, w, s, si):
      return contraction.einsum("ad,adf->af", a, w[e], None if s is None else s[e], quant,
                                out_dtype=jnp.float32, input_scale=si)
    h = (jax.nn.silu(mm(z, weights[0], scales[0], input_scales[0]))
         * mm(z, weights[1], scales[1], input_scales[1]))
    y = mm(h.astype(x_nd.dtype), weights[2], scales[2], input_scales[2])
    return y.reshape(N, k, D).sum(axis=1).astype(x_nd.dtype)

  order = jnp.argsort(e, stable=True)
  expert_sorted = e[order]
  group_sizes = jnp.bincount(e, length=E).astype(jnp.int32)

  def mm(a, w, s, si=None):
    if s is None:
      return grouped_matmul(a, w, group_sizes, impl=impl)
    if si is not None:  # static per-tensor activation scale
      acc = grouped_matmul(quant_lib.quantize_static(a, si), w, group_sizes, impl=impl,
                           kmajor=True) * jnp.asarray(si, jnp.float32)
    elif quant is not None and quant.quantize_activations:
      aq, a_scale = quant_lib.quantize_rows(a, (-1,), quant.activation_scale_ub)
      acc = grouped_matmul(aq, w, group_sizes, impl=impl, kmajor=True) * a_scale[:, None]
    else:
      acc = grouped_matmul(a, w, group_sizes, impl=impl, kmajor=True)
    return acc * s[expert_sorted].astype(jnp.float32)

  a = z[order]
  h = (jax.nn.silu(mm(a, weights[0], scales[0], input_scales[0]))
       * mm(a, weights[1], scales[1], input_scales[1])).astype(x_nd.dtype)
  y = mm(h, weights[2], scales[2], input_scales[2]).astype(x_nd.dtype)
  token = order // k
  return jnp.zeros((N, D), jnp.float32).at[token].add(y).astype(x_nd.dtype)


def swiglu(x: jax.Array, gate_df: jax.Array, up_df: jax.Array, down_fd: jax.Array,
           scales=(None, None, None), quant=None, kernels: str | None = "xla",
           placements=(None, None, None), input_scales=(None, None, None), fuse=None):
  """scales: per-output-channel scales of FP8 gate/up/down (None for an unquantized weight);
  placements: the weights' kernel placements on a sharded model (see `_placement`);
  input_scales: their static activation scales (quant activations "static_per_tensor");
  fuse: the down projection's all-reduce fused with the residual add and norm
  (`maverick.kernels.Fuse`; contraction.einsum then may return (new residual, normed))."""
  fused = fused_mlp.swiglu(x, gate_df, up_df, down_fd, scales, quant, kernels, placements,
                           input_scales, fuse)
  if fused is not None:
    return fused
  mm = functools.partial(contraction.einsum, kernels=kernels)
  g, u = contraction.einsum_many("...d,df->...f", x, (gate_df, up_df), scales[:2], quant,
                                 kernels=kernels, placements=placements[:2],
                                 input_scales=input_scales[:2])
  return mm("...f,fd->...d", jax.nn.silu(g) * u, down_fd, scales[2], quant,
            placement=placements[2], input_scale=input_scales[2], fuse=fuse)


# ----------------------------------------------------------------------------------------------
# Sharded MoE
# ----------------------------------------------------------------------------------------------
def sharded_moe(plan: Plan, x_nd, router_de, gate_edf, up_edf, down_efd, shared, *, top_k: int,
                impl: str, router_scale=None, scales=(None, None, None),
                shared_scales=(None, None, None), quant=None, kernels: str | None = "xla",
                router_input_scale=None, input_scales=(None, None, None),
                shared_input_scales=(None, None, None), fuse=None):
  """Llama 4 MoE (routed + shared expert) inside shard_map with one psum at the end.

  shared: (gate [D,F], up [D,F], down [F,D]) of the shared expert. FP8 weights come with their
  per-output-channel scales (router [E], experts (gate [E,F], up [E,F], down [E,D]), shared (gate
  [F], up [F], down [D])), sharded like the output axis of their weight; None = unquantized.
  `kernels` (maverick.kernels): the grouped GEMM and shared-expert GEMM kernels run here, in the
  shard_map, on the local experts / expert widths. Static FP8 activation scales (router, experts
  (gate, up, down), shared (gate, up, down); f32 scalars) are replicated: quantizing with one
  global scalar is elementwise, so every shard quantizes its slice exactly as one device would.
  `fuse` (`maverick.kernels.Fuse`, residual [N, D]): the final psum is the fused all-reduce +
  residual add + RMSNorm; returns (new residual, normed) [N, D] each."""
  rows = plan.batch_axis(x_nd.shape[0])
  ex, tp = plan.rules["experts"], plan.rules["expert_mlp"]
  # Rows split over the expert axis (data-parallel attention) are gathered before routing, every
  # shard runs its experts on all of them, and a reduce-scatter returns each shard its rows.
  dp_experts = ex is not None and ex in ((rows,) if isinstance(rows, str) else (rows or ()))
  reduce_axes = tuple(a for a in (ex, tp) if a is not None and plan.size(a) > 1
                      and not (dp_experts and a == ex))
  P = PartitionSpec

  def local(x_own, router, gate, up, down, sg, su, sd, r_scale, e_scales, s_scales, statics,
            fused_in, x_quantized, x_padded):
    r_in, e_in, s_in = statics
    if x_quantized is not None:
      kernels_lib.remember_quantized(x_own, *x_quantized, quant.activation_scale_ub)
    if x_padded is not None:
      kernels_lib.remember_padded(x_own, x_padded)
    x = jax.lax.all_gather(x_own, ex, axis=0, tiled=True) if dp_experts else x_own
    routed = None
    if top_k == 1 and r_scale is None:
      routed = kernel_moe.route_top1(x, router, kernels)
    if routed is None:
      routed = route(x, router, top_k, router_scale=r_scale, quant=quant,
                     router_input_scale=r_in)[:2]
    top_idx, scores = routed
    if ex is not None:
      e_local = gate.shape[0]
      first = jax.lax.axis_index(ex) * e_local
      idx = top_idx - first
      mine = (idx >= 0) & (idx < e_local)
      # Another shard's assignment: score 0 (input * 0 contributes exactly 0). The grouped path
      # sorts it past the last local expert, where no tile computes it; the gather path (few
      # tokens) just reads local expert 0.
      gathered = impl == "tiles" and x.shape[0] * top_k <= e_local
      top_idx = jnp.where(mine, idx, 0 if gathered else e_local)
      scores = jnp.where(mine, scores, jnp.zeros_like(scores))
    # The fused site takes the routed and the shared expert's products as two terms as the
    # kernels leave them (tile-padded rows, the shared down's K-split partials): no XLA add.
    terms = fuse is not None and ex is None
    shared_in = None  # the shared expert's gate / up, its SwiGLU quantized beside the routed rows
    if terms and fused_mlp.takes(s_scales, quant, s_in):
      shared_in = fused_mlp.shared_gate_up(x, sg, su, sd, *s_scales, quant=quant,
                                           kernels=kernels)
    y = moe_experts(x, top_idx, scores, gate, up, down, impl=impl, scales=e_scales,
                    quant=quant, kernels=kernels, input_scales=e_in, keep_row_padding=terms,
                    shared=shared_in)
    shared_partials = None
    if isinstance(y, tuple):  # the shared SwiGLU rows came from the routed quantize launch
      y, (hq, hs) = y
      shared_partials = fused_mlp.shared_down(hq, hs, sd, s_scales[2], x.dtype)
    elif terms and fused_mlp.takes(s_scales, quant, s_in) and y.shape[0] >= x.shape[0]:
      shared_partials = fused_mlp.local_partials(x, sg, su, sd, *s_scales, quant=quant,
                                                 kernels=kernels)
    if shared_partials is not None:
      r, w, sems = fused_in
      return kernels_lib.fused_allreduce_norm((shared_partials, y), r, w, fuse, reduce_axes,
                                              plan.mesh, semaphores=sems)
    y = y[:x.shape[0]]
    if dp_experts:  # own rows, summed over expert shards; the shared expert on own rows only
      y = jax.lax.psum_scatter(y, ex, scatter_dimension=0, tiled=True)
      s = swiglu(x_own, sg, su, sd, s_scales, quant, kernels, input_scales=s_in)
    else:
      s = swiglu(x, sg, su, sd, s_scales, quant, kernels, input_scales=s_in)
      if ex is not None:  # every expert shard has the shared expert's slice: count it once
        s = jnp.where(jax.lax.axis_index(ex) == 0, s, jnp.zeros_like(s))
    if fuse is not None:
      r, w, sems = fused_in
      return kernels_lib.fused_allreduce_norm(y + s, r, w, fuse, reduce_axes, plan.mesh,
                                              semaphores=sems)
    return jax.lax.psum(y + s, reduce_axes) if reduce_axes else y + s

  scale_specs = lambda ss, specs: tuple(None if s is None else p for s, p in zip(ss, specs))

  def w_spec(declared, scale):  # an FP8 weight is stored K-major: its input axis moved last
    if scale is None:
      return P(*declared)
    return P(*(declared[i] for i in quant_lib.kmajor_order(len(declared), (len(declared) - 2,))))

  e_gate, e_up, e_down = scales
  s_gate, s_up, s_down = shared_scales
  statics = (router_input_scale, tuple(input_scales), tuple(shared_input_scales))
  static_specs = jax.tree.map(lambda _: P(), statics)
  sems = None if fuse is None else kernels_lib.site_semaphores(fuse.residual.shape)
  out_specs = P(rows, None)
  if fuse is not None:
    out_specs, fuse = kernels_lib._fused_out_specs(fuse, out_specs)
  # The normed rows' FP8 form from the fused site before (the shared expert's gate/up take it).
  x_quantized = x_padded = None
  if rows is None and quant is not None:
    x_quantized = kernels_lib.quantized_rows(x_nd, quant.activation_scale_ub)
  if rows is None:  # and the same rows tile-padded in bf16, for the router GEMM
    x_padded = kernels_lib.padded_rows(x_nd)
  f = jax.shard_map(
      local, mesh=plan.mesh,
      in_specs=(P(rows, None), P(None, None),
                w_spec((ex, None, tp), e_gate), w_spec((ex, None, tp), e_up),
                w_spec((ex, tp, None), e_down), w_spec((None, tp), s_gate),
                w_spec((None, tp), s_up), w_spec((tp, None), s_down),
                None if router_scale is None else P(None),
                scale_specs(scales, (P(ex, tp), P(ex, tp), P(ex, None))),
                scale_specs(shared_scales, (P(tp), P(tp), P(None))), static_specs,
                None if fuse is None else (P(rows, None), P(None),
                                           None if sems is None else P()),
                None if x_quantized is None else (P(None, None), P(None)),
                None if x_padded is None else P(None, None)),
      out_specs=out_specs, check_vma=False)
  fused_in = None if fuse is None else (fuse.residual, fuse.weight, sems)
  out = f(x_nd, router_de, gate_edf, up_edf, down_efd, *shared, router_scale, tuple(scales),
          tuple(shared_scales), statics, fused_in, x_quantized, x_padded)
  return out if fuse is None else kernels_lib._remember_site(out, fuse)
