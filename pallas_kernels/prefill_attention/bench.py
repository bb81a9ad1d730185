"""Benchmark cases for benchmarks/kernels.py: prefill attention at Maverick shapes vs cuDNN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common
from pallas_kernels.prefill_attention.api import prefill_attention


def _cudnn_causal(q, k, v, lengths):
  # cuDNN flash attention, causal; it takes GQA (K | H) directly. lengths are all T in these cases.
  del lengths
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def _case(name, B, T, H, K, Dh, chunk_size, toy, seed=0):
  rng = np.random.default_rng(seed)
  args = (jnp.asarray(rng.normal(size=(B, T, H, Dh)), jnp.bfloat16),
          jnp.asarray(rng.normal(size=(B, T, K, Dh)), jnp.bfloat16),
          jnp.asarray(rng.normal(size=(B, T, K, Dh)), jnp.bfloat16),
          jnp.full((B,), T, jnp.int32))
  call = lambda impl: lambda q, k, v, n: prefill_attention(
      q, k, v, lengths=n, chunk_size=chunk_size, implementation=impl)
  # Visible (query, key) pairs: causal within each chunk.
  c = chunk_size or T
  full, rest = divmod(T, c)
  pairs = full * c * (c + 1) // 2 + rest * (rest + 1) // 2
  baselines = {}
  if not toy:
    # cuDNN's local_window_size is a sliding window, not aligned chunks; with chunk_size >= T the
    # chunked mask is exactly global causal, so the comparison is like for like at T <= 8192.
    assert chunk_size is None or chunk_size >= T
    baselines["cudnn_causal"] = _cudnn_causal
  return common.BenchCase(
      op="prefill_attention", name=name, args=args, kernel=call("pallas"),
      reference=call("xla"), baselines=baselines,
      flops=4.0 * B * H * Dh * pairs,
      bytes=2.0 * (2 * B * T * H * Dh + 2 * B * T * K * Dh),
      max_rel_error=2e-2,  # bf16 output and bf16 probabilities in P V
      goal=">= 1.0x cudnn causal (FA3-class: >= 50% of bf16 tensor-core peak)")


def benchmark_cases(toy: bool) -> list[common.BenchCase]:
  if toy:
    return [_case("toy prefill B=1 T=40 H=4 K=1 Dh=64 chunk=24", 1, 40, 4, 1, 64, 24, toy),
            _case("toy prefill B=1 T=64 H=2 K=2 Dh=128 global", 1, 64, 2, 2, 128, None, toy)]
  cases = []
  for T in (2048, 8192):
    for chunk in (8192, None):
      kind = "chunked(8192)" if chunk else "global"
      cases.append(_case(f"prefill B=1 T={T} H=40 K=8 Dh=128 {kind}", 1, T, 40, 8, 128, chunk, toy))
  return cases
