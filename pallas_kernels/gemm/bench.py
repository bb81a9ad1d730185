"""Benchmark cases for `gemm` (see benchmarks/kernels.py): Maverick decode shapes, where the weight
stream is the cost (goal: >= 80% of HBM bandwidth), and prefill shapes, where the tensor cores are
(goal: >= 1.0x XLA's FP8 dot with the scales applied as an XLA epilogue)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import BenchCase
from pallas_kernels.gemm import api, reference

FP8 = jnp.float8_e4m3fn


def _case(name, m, n, k, dtype, seed, goal):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(m, k)), dtype)
  w = jnp.asarray(rng.normal(size=(n, k)) * 0.05, dtype)
  scaled = jnp.dtype(dtype) == jnp.dtype(FP8)
  xs = jnp.asarray(rng.uniform(0.5, 2, size=m), jnp.float32) if scaled else None
  ws = jnp.asarray(rng.uniform(0.5, 2, size=n), jnp.float32) if scaled else None
  item = jnp.dtype(dtype).itemsize
  ref = functools.partial(reference.gemm, out_dtype=jnp.bfloat16)
  baseline = "xla_fp8_dot_scaled" if scaled else "xla_bf16_dot"
  return BenchCase(
      op="gemm", name=f"{name} {jnp.dtype(dtype).name} M={m} N={n} K={k}",
      args=(x, w, xs, ws),
      kernel=functools.partial(api.gemm, implementation="pallas"),
      reference=ref, baselines={baseline: ref},
      flops=2.0 * m * n * k, bytes=float((m + n) * k * item + m * n * 2 + (m + n) * 4 * scaled),
      max_rel_error=2.0 ** -7, goal=goal)


def benchmark_cases(toy: bool) -> list[BenchCase]:
  if toy:
    return [_case("decode", 5, 128, 256, FP8, 0, ""), _case("prefill", 130, 128, 256, FP8, 1, "")]
  hbm, xla = ">= 80% of HBM bandwidth", ">= 1.0x xla_fp8_dot_scaled"
  return [
      _case("decode", 16, 16384, 5120, FP8, 0, hbm),  # dense MLP gate/up, batch 16
      _case("decode", 64, 5120, 16384, FP8, 1, hbm),  # dense MLP down, batch 16 x 4 (verify)
      _case("decode", 16, 5120, 5120, FP8, 2, hbm),  # attention projection-sized
      _case("prefill", 8192, 16384, 5120, FP8, 3, xla),
      _case("prefill", 8192, 5120, 16384, FP8, 4, xla),
      _case("prefill", 8192, 16384, 5120, jnp.bfloat16, 5, ">= 1.0x xla_bf16_dot"),
  ]
