"""The XLA reference: psum of the bf16 payload, then the residual add and HF RMSNorm in f32."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

PAYLOAD_DTYPE = jnp.dtype(jnp.bfloat16)  # the kernel's payload (its residual and weight too)


def residual_norm(summed, residual, weight, eps: float):
  """(new residual, its RMSNorm): h = residual + summed (f32 add, rounded to residual.dtype, as
  the model's `x + a` does in bf16); normed = HF RMSNorm of h (normalise in f32, cast, then times
  the weight)."""
  h = (residual.astype(jnp.float32) + summed.astype(jnp.float32)).astype(residual.dtype)
  hf = h.astype(jnp.float32)
  y = (hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)).astype(h.dtype)
  return h, y * weight


def payload_dtype(residual_dtype):
  """The all-reduce payload: the residual stream's dtype (bf16 in a bf16 model, never f32 sums
  there; an f32 model, as tests use, keeps f32: bf16 partials would cost it 1e-2 relative)."""
  return jnp.dtype(residual_dtype)


def is_split(term, residual) -> bool:
  """Whether a partial term is a K-split GEMM's [S, R, D] partials (not [..., D] like the
  residual, nor [R, D] row padded)."""
  return term.ndim == 3 and term.shape != residual.shape


def local_sum(terms, residual):
  """This device's payload: the terms summed in f32 and cut to the residual's rows, in the
  payload dtype; in f32 when a K split's f32 partials are among them (the kernel sums those in
  f32 and never rounds them)."""
  rows, d = math.prod(residual.shape[:-1]), residual.shape[-1]
  total, wide = 0, False
  for t in terms:
    split = is_split(t, residual)
    wide |= split and jnp.dtype(t.dtype) == jnp.float32
    t = t.astype(jnp.float32)
    t = t.sum(0) if split else t.reshape(-1, d)
    total = total + t[:rows]
  dtype = jnp.float32 if wide else payload_dtype(residual.dtype)
  return total.reshape(residual.shape).astype(dtype)


def allreduce_residual_norm(partial, residual, weight, eps: float, axis_name):
  """Inside shard_map: the partial sums (one array, or a tuple of terms: `local_sum`)
  all-reduced over `axis_name` as the payload."""
  terms = partial if isinstance(partial, (tuple, list)) else (partial,)
  summed = jax.lax.psum(local_sum(terms, residual), axis_name)
  return residual_norm(summed, residual, weight, eps)
