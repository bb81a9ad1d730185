"""The one contraction every quantized layer goes through: `einsum` (exported as
`maverick.quant.einsum`).

`einsum` is the seam for an FP8 GEMM kernel: it computes an FP8 x FP8 product with f32 accumulation
(`preferred_element_type`), then applies the activation and weight scales in the epilogue, exactly
what a fused kernel does, so a Pallas kernel can replace the body without touching the model.
Where a Pallas kernel takes the call (`kernels`), maverick.kernels runs it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maverick import kernels as kernels_lib
from maverick import multi_linear
from maverick.quant.config import QuantConfig
from maverick.quant.ops import _expand_ellipsis, kmajor_spec, quantize_rows, quantize_static


def _align(a: jax.Array, subs: str, out: str) -> jax.Array:
  """Transposes/reshapes `a` (subscripts `subs`, all in `out`) to broadcast against `out`."""
  order = sorted(range(len(subs)), key=lambda i: out.index(subs[i]))
  a = jnp.transpose(a, order)
  kept = "".join(subs[i] for i in order)
  return a.reshape([a.shape[kept.index(c)] if c in kept else 1 for c in out])


def einsum(spec: str, x: jax.Array, w: jax.Array, scale: jax.Array | None = None,
           quant: QuantConfig | None = None, out_dtype=None, kernels: str | None = "xla",
           placement=None, input_scale: jax.Array | None = None, fuse=None):
  """`jnp.einsum(spec, x, w)`, with `w` in FP8 when `scale` is given.

  Without a scale this IS jnp.einsum (the unquantized model is bit-identical). With one, w is FP8
  stored K-major (`to_kmajor`): `spec` still names the declared layout (the same spec serves a
  BF16 and an FP8 model) and the array holds its output axes first, then its contracted axes.
  `scale` has w's non-contracted axes (per output channel); per `quant.activations`, x is
  quantized per token over its contracted axes (FP8 x FP8) or kept (weight-only, w upcast to x's
  dtype). The product
  accumulates in f32; scales are applied to the accumulator; the result has x's dtype.
  `kernels` (see maverick.kernels): None/"pallas" run the Pallas GEMM where it takes the call;
  `placement` = (sharding plan, w's logical axes) on a sharded model: the GEMM runs per shard.
  `input_scale` (f32 scalar): the static activation scale of `quant.activations ==
  "static_per_tensor"` (x is quantized as e4m3(clip(x / input_scale)), the accumulator multiplied
  by input_scale); the Pallas GEMM takes it as it takes the per-token mode.
  `fuse` (`maverick.kernels.Fuse`, a row-parallel product on a sharded model's kernel path): the
  all-reduce is fused with the residual add and the next RMSNorm; returns (new residual, normed)
  instead of the product when the site fuses (see maverick.kernels.fuses_residual_norm).
  """
  static = scale is not None and quant is not None and quant.static_activations
  if static and input_scale is None:
    raise ValueError(f"einsum {spec!r}: quant activations 'static_per_tensor' needs the weight's "
                     "input_scale")
  if scale is not None:
    spec = kmajor_spec(spec, x.ndim)
  if kernels != "xla":
    xla = lambda x_, w_, s_, si_: _xla_einsum(spec, x_, w_, s_, quant, out_dtype, si_)
    y = kernels_lib.linear(spec, x, w, scale, quant, kernels, out_dtype, placement, input_scale,
                           fuse=fuse, xla=xla)
    if y is not None:
      return y
  return _xla_einsum(spec, x, w, scale, quant, out_dtype, input_scale)


def einsum_many(spec: str, x: jax.Array, ws, scales, quant: QuantConfig | None = None,
                out_dtype=None, kernels: str | None = "xla", placements=None,
                input_scales=None) -> list[jax.Array]:
  """[einsum(spec, x, w, scale, ...) for each weight] of one input x (q, k, v; gate, up): ONE
  kernel launch for all of them where the GEMM kernel takes them (maverick.multi_linear; x
  quantized once), else each its own `einsum`, the same math."""
  n = len(ws)
  placements = placements or (None,) * n
  input_scales = input_scales or (None,) * n
  if kernels != "xla" and len({s is None for s in scales}) == 1:
    stored = spec if scales[0] is None else kmajor_spec(spec, x.ndim)
    ys = multi_linear.linear_many(stored, x, ws, scales, quant, kernels, placements,
                                  input_scales, out_dtype)
    if ys is not None:
      return list(ys)
  return [einsum(spec, x, w, s, quant, out_dtype, kernels, p, si)
          for w, s, p, si in zip(ws, scales, placements, input_scales)]


def _xla_einsum(spec, x, w, scale, quant, out_dtype, input_scale):
  """`einsum`'s XLA path (`spec` already in the stored layout)."""
  static = scale is not None and quant is not None and quant.static_activations
  if scale is None:
    if out_dtype is not None and jnp.dtype(out_dtype) != x.dtype:
      return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)
    return jnp.einsum(spec, x, w)
  out_dtype = out_dtype or x.dtype
  xs, ws, out = _expand_ellipsis(spec, x.ndim)
  contracted = [c for c in xs if c in ws and c not in out]
  x_keep = "".join(c for c in xs if c not in contracted)
  w_keep = "".join(c for c in ws if c not in contracted)
  if scale.ndim != len(w_keep):
    raise ValueError(f"einsum {spec!r}: scale has shape {scale.shape}, expected one entry per "
                     f"output channel of w (axes {w_keep!r} of {w.shape})")
  full = f"{xs},{ws}->{out}"
  if static:
    acc = jnp.einsum(full, quantize_static(x, input_scale), w, preferred_element_type=jnp.float32)
    acc = acc * jnp.asarray(input_scale, jnp.float32)
  elif quant is not None and quant.quantize_activations:
    xq, x_scale = quantize_rows(x, [xs.index(c) for c in contracted], quant.activation_scale_ub)
    acc = jnp.einsum(full, xq, w, preferred_element_type=jnp.float32)
    acc = acc * _align(x_scale, x_keep, out)
  else:
    acc = jnp.einsum(full, x, w.astype(x.dtype), preferred_element_type=jnp.float32)
  return (acc * _align(scale.astype(jnp.float32), w_keep, out)).astype(out_dtype)
