"""Where the model meets `pallas_kernels`: one switch per model, `kernels`.

  None      auto (the default): a Pallas kernel wherever one can run (a Hopper/Blackwell GPU, or
            inside `pallas_kernels.interpret()`) and takes the call's shapes/dtypes; XLA elsewhere;
  "pallas"  the same, but it is an error when there is nothing to run kernels on;
  "xla"     the plain-jnp reference everywhere.

Set it with `set_kernels(model, ...)` (or `maverick.load(..., kernels=...)`, `--kernels`). Calls a
kernel does not take (weight-only FP8, a head_dim other than 64/128, ...) always fall back to
XLA, so one model mixes both. Each helper returns None when the caller should run its XLA
path; the callers keep their XLA code as the reference.

Sharded models: a Mosaic GPU custom call cannot be partitioned by XLA, so kernels would need
shard_map wrappers per layout; `sharding.shard_model` therefore pins sharded models to "xla".
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import common
from pallas_kernels import gemm as gemm_lib

KERNELS = (None, "xla", "pallas")


def set_kernels(model, kernels: str | None) -> None:
  """Selects the implementation for every layer of `model` (target or draft)."""
  if kernels not in KERNELS:
    raise ValueError(f"kernels={kernels!r}; choose one of {KERNELS} (None = auto)")
  if kernels == "pallas":
    common.target_arch()  # raises, naming the fix, when there is no GPU and no interpret mode
    from maverick import sharding  # local: sharding imports the model
    if sharding.plan_of(model) is not None:
      raise common.KernelInputError(
          "kernels='pallas' on a sharded model: the kernels are not wired through shard_map yet; "
          "use kernels=None or 'xla' for sharded models")
  model.set_attributes(kernels=kernels, raise_if_not_found=False)


def use_pallas(kernels: str | None, supported: bool) -> bool:
  if kernels == "xla":
    return False
  if kernels == "pallas":
    common.target_arch()
    return supported
  if kernels is None:
    return supported and common.runnable_arch() is not None
  raise ValueError(f"kernels={kernels!r}; choose one of {KERNELS} (None = auto)")


def linear(spec: str, x: jax.Array, w: jax.Array, scale, quant, kernels: str | None,
           out_dtype=None):
  """`maverick.quant.einsum` through the Pallas GEMM when the spec is x[batch..., C...] .
  w[C..., O...] (stored K-by-N) or w[O..., C...] (K-major) -> [batch..., O...], which covers every
  projection in the model: the operands then reshape for free into x [M, K] and w [K, N] / [N, K].
  FP8 weights (with `scale`) need the K-major layout; activations are quantized per token first
  when `quant` says so, exactly as the XLA path does."""
  if kernels == "xla":
    return None
  from maverick.quant import ops as quant_ops  # local: quant.ops calls into this module
  xs, ws, out = quant_ops._expand_ellipsis(spec, x.ndim)
  contracted = "".join(c for c in xs if c in ws and c not in out)
  n_c = len(contracted)
  if not contracted or xs[-n_c:] != contracted:
    return None
  if ws[:n_c] == contracted and out == xs[:-n_c] + ws[n_c:]:
    layout, w_out = "kn", w.shape[n_c:]
  elif ws[-n_c:] == contracted and out == xs[:-n_c] + ws[:-n_c]:
    layout, w_out = "nk", w.shape[:-n_c]
  else:
    return None
  k, n = math.prod(x.shape[-n_c:]), math.prod(w_out)
  quantize_x = scale is not None and quant is not None and quant.quantize_activations
  x_dtype = quant_ops.FP8 if quantize_x else x.dtype
  ok, _ = gemm_lib.pallas_support(x_dtype, w.dtype, n, k, layout, m=math.prod(x.shape[:-n_c]),
                                  out_dtype=out_dtype or x.dtype)
  if not use_pallas(kernels, ok):
    return None
  batch = x.shape[:-n_c]
  x2 = x.reshape(-1, k)
  x_scale = None
  if quantize_x:
    x2, x_scale = quant_ops.quantize_rows(x2, (-1,), quant.activation_scale_ub)
  w2 = w.reshape((k, n) if layout == "kn" else (n, k))
  w_scale = None if scale is None else scale.reshape(n)
  y = gemm_lib.gemm(x2, w2, x_scale, w_scale, w_layout=layout, out_dtype=out_dtype or x.dtype,
                    implementation="pallas")
  return y.reshape(*batch, *w_out)


def moe_experts(x_nd, top_idx, scores, gate_edf, up_edf, down_efd, kernels: str | None, *,
                scales=None, quant=None):
  """Routed experts through the grouped GEMM kernels, or None: assignments sorted by expert,
  gate/up + SwiGLU fused in one kernel, down in another. BF16 experts are read in the declared
  (E, in, out) layout; FP8 ones (`scales` = (gate, up, down) per-channel scales, all three set) in
  the K-major layout they are stored in, each kernel's input rows quantized per token as the XLA
  path does (weight-only FP8 has no kernel). Decode too: empty groups cost nothing, so there is
  no gather path."""
  if kernels == "xla":
    return None
  from pallas_kernels import grouped_gemm
  from maverick.quant import ops as quant_ops  # local: quant.ops calls into this module
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
  if fp8:
    ok = (all(s is not None for s in scales) and quant is not None and quant.quantize_activations
          and gate_edf.dtype == up_edf.dtype == down_efd.dtype == quant_ops.FP8)
  else:
    ok = gate_edf.dtype == up_edf.dtype == down_efd.dtype == x_nd.dtype
  ok = (ok and grouped_gemm.pallas_support(rows, gate_edf, x_scale=row_scale,
                                           w_scale=scales and scales[0], w_layout=layout,
                                           swiglu=True, out_dtype=x_nd.dtype)[0]
        and grouped_gemm.pallas_support(hidden, down_efd, x_scale=row_scale,
                                        w_scale=scales and scales[2], w_layout=layout,
                                        out_dtype=x_nd.dtype)[0])
  if not use_pallas(kernels, ok):
    return None
  flat_expert = top_idx.reshape(-1)
  order = jnp.argsort(flat_expert, stable=True)
  token = order // k
  x_sorted = x_nd[token] * scores.reshape(-1)[order][:, None]  # the score scales the INPUT
  group_sizes = jnp.bincount(flat_expert, length=E).astype(jnp.int32)

  def rows_in(a):  # (kernel input, its per-row scale)
    if not fp8:
      return a, None
    return quant_ops.quantize_rows(a, (-1,), quant.activation_scale_ub)

  s_gate, s_up, s_down = scales if fp8 else (None, None, None)
  xq, x_scale = rows_in(x_sorted)
  h = grouped_gemm.grouped_swiglu(xq, gate_edf, up_edf, group_sizes, x_scale=x_scale,
                                  gate_scale=s_gate, up_scale=s_up, w_layout=layout,
                                  out_dtype=x_nd.dtype, implementation="pallas")
  hq, h_scale = rows_in(h)
  y = grouped_gemm.grouped_matmul(hq, down_efd, group_sizes, x_scale=h_scale, w_scale=s_down,
                                  w_layout=layout, out_dtype=x_nd.dtype, implementation="pallas")
  return jnp.zeros((N, D), jnp.float32).at[token].add(y).astype(x_nd.dtype)


def prefill_attention(q, k, v, chunk_size: int | None, kernels: str | None):
  """Causal (chunked) self-attention of a prompt at positions 0..T-1, or None."""
  if kernels == "xla":
    return None
  from pallas_kernels import prefill_attention as prefill
  ok = prefill.pallas_support(q, k, v)[0]
  if not use_pallas(kernels, ok):
    return None
  return prefill.prefill_attention(q, k, v, chunk_size=chunk_size, implementation="pallas")


def cache_attention(q, k_cache, v_cache, q_positions, chunk_size: int | None, tree,
                    kv_scales: dict, kernels: str | None):
  """Decode / verify / tree-verify attention of T new queries over the KV cache, or None."""
  if kernels == "xla":
    return None
  from pallas_kernels import decode_attention as decode
  ok = (decode.pallas_support(q, k_cache, None if tree is None else tree.positions.shape[1])[0]
        and q.shape[1] <= 64)
  if not use_pallas(kernels, ok):
    return None
  tree_args = {}
  if tree is not None:
    tree_args = dict(tree_start=tree.start, tree_positions=tree.positions,
                     tree_visible=tree.visible)
  return decode.decode_attention(q, k_cache, v_cache, q_positions, chunk_size=chunk_size,
                                 **kv_scales, **tree_args, implementation="pallas")
