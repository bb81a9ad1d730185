"""The XLA reference: psum of the bf16 payload, then the residual add and HF RMSNorm in f32."""

from __future__ import annotations

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


def allreduce_residual_norm(partial, residual, weight, eps: float, axis_name):
  """Inside shard_map: the partial sums all-reduced over `axis_name` as the payload dtype."""
  summed = jax.lax.psum(partial.astype(payload_dtype(residual.dtype)), axis_name)
  return residual_norm(summed, residual, weight, eps)
