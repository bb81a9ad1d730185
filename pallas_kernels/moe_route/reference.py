"""The XLA reference: Llama 4's top-1 routing from the router GEMM's output, as
maverick.moe.route computes it (bf16 logits, the first argmax, sigmoid of the max logit)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route_top1(partials, rows: int, logits_dtype=jnp.bfloat16, score_dtype=jnp.bfloat16):
  """partials [S, R >= rows, E] (summed over S: the router logits in f32) -> (expert ids int32
  [rows, 1], scores [rows, 1] in score_dtype)."""
  logits = jnp.sum(partials.astype(jnp.float32), axis=0)[:rows].astype(logits_dtype)
  top = jnp.argmax(logits, axis=-1, keepdims=True).astype(jnp.int32)
  score = jnp.max(jax.nn.sigmoid(logits.astype(jnp.float32)), axis=-1, keepdims=True)
  return top, score.astype(score_dtype)
