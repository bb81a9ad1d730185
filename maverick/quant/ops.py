"""FP8 (e4m3) quantization primitives: formats, scales, the K-major layout, einsum specs.

Weights: symmetric, one f32 scale per output channel, `scale = max|w| / 448` over the input axes (a
channel of zeros gets scale 1). Activations: the same per token (per row of the contraction), computed
at run time, with the row maximum clamped to [1/512, activation_scale_ub] so all-zero rows give no
0/0 and huge rows no overflow (e4m3fn has no infinity: out-of-range casts become NaN, so values are
clipped to +-448 before the cast). KV cache: one scale per token and kv head.

The contraction every quantized layer goes through, `einsum`, is in maverick.quant.contraction
(above maverick.kernels, which it dispatches to; the kernels use these primitives).
"""

from __future__ import annotations

import string
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0
# A row's max |x| is raised to at least this before scaling (vLLM/fbgemm use the same floor).
MIN_ROW_AMAX = 1.0 / 512.0


class QuantError(ValueError):
  """A tensor that cannot be quantized (NaN/inf) or a malformed quantized tensor."""


def _to_fp8(x_f32: jax.Array) -> jax.Array:
  return jnp.clip(x_f32, -FP8_MAX, FP8_MAX).astype(FP8)


def quantize_weight(w, in_axes: Sequence[int]) -> tuple[jax.Array, jax.Array]:
  """(e4m3 weight, f32 scale) with one scale per output channel: the scale's shape is w's shape
  without `in_axes` (the contracted axes). Dequantize with `dequantize(q, scale, in_axes)`."""
  wf = jnp.asarray(w).astype(jnp.float32)
  axes = tuple(a % wf.ndim for a in in_axes)
  amax = jnp.max(jnp.abs(wf), axis=axes, keepdims=True)
  scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
  return _to_fp8(wf / scale), jnp.squeeze(scale, axis=axes)


def kmajor_order(ndim: int, in_axes: Sequence[int]) -> tuple[int, ...]:
  """The axis order an FP8 weight is stored in: its output axes, then its contracted (input) axes,
  each group in declaration order. FP8 tensor cores (wgmma, tcgen05) read only K-major operands."""
  ins = tuple(sorted(a % ndim for a in in_axes))
  return tuple(a for a in range(ndim) if a not in ins) + ins


def to_kmajor(w, in_axes: Sequence[int]):
  """A weight in its declared (input..., output...) layout -> the K-major layout FP8 is stored in."""
  return w.transpose(kmajor_order(w.ndim, in_axes))


def from_kmajor(w_kmajor, in_axes: Sequence[int]):
  """Inverse of `to_kmajor`: `in_axes` are the contracted axes of the declared layout."""
  return w_kmajor.transpose(np.argsort(kmajor_order(w_kmajor.ndim, in_axes)))


def kmajor_spec(spec: str, ndim_x: int) -> str:
  """The einsum spec of a weight stored K-major, from the spec of its declared layout."""
  xs, ws, out = _expand_ellipsis(spec, ndim_x)
  contracted = [c for c in ws if c in xs and c not in out]
  kept = "".join(c for c in ws if c not in contracted)
  return f"{xs},{kept}{''.join(contracted)}->{out}"


def dequantize(q, scale, in_axes: Sequence[int], dtype=jnp.float32) -> jax.Array:
  q = jnp.asarray(q)
  axes = tuple(a % q.ndim for a in in_axes)
  return (q.astype(jnp.float32) * jnp.expand_dims(jnp.asarray(scale, jnp.float32), axes)
          ).astype(dtype)


def row_scales(x_f32: jax.Array, axes: Sequence[int], ub: float | None = None) -> jax.Array:
  """Clamped per-row scales (keepdims over `axes`)."""
  amax = jnp.max(jnp.abs(x_f32), axis=tuple(axes), keepdims=True)
  amax = jnp.maximum(amax, MIN_ROW_AMAX)
  if ub is not None:
    amax = jnp.minimum(amax, ub)
  return amax / FP8_MAX


def quantize_rows(x, axes: Sequence[int] = (-1,), ub: float | None = None
                  ) -> tuple[jax.Array, jax.Array]:
  """Dynamic quantization: (e4m3 x, f32 scale with `axes` reduced away). NaN-free for any finite x."""
  xf = jnp.asarray(x).astype(jnp.float32)
  axes = tuple(a % xf.ndim for a in axes)
  s = row_scales(xf, axes, ub)
  return _to_fp8(xf / s), jnp.squeeze(s, axis=axes)


def quantize_kv(x_btkd: jax.Array) -> tuple[jax.Array, jax.Array]:
  """KV cache entries [B, T, K, Dh] -> (e4m3, scale [B, T, K])."""
  return quantize_rows(x_btkd, (-1,))


def check_finite(name: str, x) -> None:
  """Raises QuantError naming the tensor when it holds NaN or inf (host check, before quantizing)."""
  x = np.asarray(x)
  if x.dtype == FP8:  # e4m3fn has no inf; NaN is S.1111.111
    bad = int(np.count_nonzero((x.view(np.uint8) & 0x7F) == 0x7F))
  else:
    bad = int(np.count_nonzero(~np.isfinite(x.astype(np.float32))))
  if bad:
    raise QuantError(f"{name} has {bad} NaN/inf value(s) out of {x.size}; fix or retrain the "
                     "checkpoint before quantizing (a scale cannot represent them)")


# ----------------------------------------------------------------------------------------------
# Einsum specs and static activations
# ----------------------------------------------------------------------------------------------
def _expand_ellipsis(spec: str, ndim_x: int) -> tuple[str, str, str]:
  ins, out = spec.replace(" ", "").split("->")
  xs, ws = ins.split(",")
  if "..." in ws:
    raise ValueError(f"einsum {spec!r}: '...' is only supported on the activation operand")
  if "..." in xs:
    free = [c for c in string.ascii_uppercase if c not in spec]
    n = ndim_x - (len(xs) - 3)
    fill = "".join(free[:n])
    xs, out = xs.replace("...", fill), out.replace("...", fill)
  return xs, ws, out


def quantize_static(x, input_scale) -> jax.Array:
  """Static per-tensor activation quantization: e4m3(clip(x / input_scale, +-448))."""
  return _to_fp8(jnp.asarray(x).astype(jnp.float32) / jnp.asarray(input_scale, jnp.float32))
