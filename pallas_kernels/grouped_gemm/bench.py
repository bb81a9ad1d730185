"""Benchmark cases for benchmarks/kernels.py: the MoE expert projections of Llama 4 Maverick.

Prefill: A=8192 tokens routed top-1 over E=128 experts with uneven (Dirichlet) loads from a fixed
seed; decode: A=16 and 64. Projections: gate/up (K=D=5120, N=F=8192) and down (K=8192, N=5120),
FP8 e4m3 with per-row and per-channel scales, f32 output (what the model consumes); plus bf16
gate/up at prefill. Baseline: `jax.lax.ragged_dot` (same dtypes, f32 preferred, then scaled).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common
from pallas_kernels.grouped_gemm import api, reference

FP8 = jnp.float8_e4m3fn


def _group_sizes(num_rows, num_groups, seed):
  rng = np.random.default_rng(seed)
  probs = rng.dirichlet(np.full(num_groups, 0.5))  # uneven expert loads, some near empty
  ids = rng.choice(num_groups, size=num_rows, p=probs)
  return jnp.asarray(np.bincount(ids, minlength=num_groups), jnp.int32)


def _weights(key, num_groups, n, k, dtype):
  w = jax.random.normal(key, (num_groups, n, k), jnp.float32 if dtype == FP8 else dtype)
  return w.astype(dtype)


def _ragged_dot_baseline(x, w, group_sizes, *scales, out_dtype):
  acc = reference.ragged_dot_nk(x, w, group_sizes)
  if scales:
    x_scale, w_scale = scales
    groups = jnp.minimum(reference.row_groups(group_sizes, x.shape[0]), w.shape[0] - 1)
    acc = acc * x_scale[:, None] * w_scale[groups]
  return acc.astype(out_dtype)


def _case(name, x, w, group_sizes, scales, out_dtype, max_rel_error, goal):
  num_rows, k = x.shape
  num_groups, n, _ = w.shape
  used_experts = int(jnp.sum(group_sizes > 0))
  kw = dict(out_dtype=out_dtype)
  if scales:
    kw_fn = lambda *s: dict(x_scale=s[0], w_scale=s[1])
  else:
    kw_fn = lambda *s: {}

  def kernel(x, w, g, *s):
    return api.grouped_matmul(x, w, g, **kw_fn(*s), **kw, implementation="pallas")

  def ref(x, w, g, *s):
    return api.grouped_matmul(x, w, g, **kw_fn(*s), **kw, implementation="xla")

  out_bytes = num_rows * n * jnp.dtype(out_dtype).itemsize
  return common.BenchCase(
      op="grouped_gemm", name=name, args=(x, w, group_sizes, *scales), kernel=kernel,
      reference=ref,
      baselines={"ragged_dot": functools.partial(_ragged_dot_baseline, out_dtype=out_dtype)},
      flops=2.0 * num_rows * n * k,
      bytes=float(used_experts * n * k * w.dtype.itemsize + x.size * x.dtype.itemsize
                  + out_bytes),
      max_rel_error=max_rel_error, goal=goal)


def benchmark_cases(toy: bool) -> list[common.BenchCase]:
  key = jax.random.key(0)
  kx, kw1, kw2, ks = jax.random.split(key, 4)
  if toy:
    num_groups, d, f = 4, 128, 128
    prefill_rows, decode_rows = (40,), (5,)
  else:
    num_groups, d, f = 128, 5120, 8192
    prefill_rows, decode_rows = (8192,), (16, 64)
  # f32 out: only accumulation order differs from XLA; bf16 out adds one output rounding.
  tol = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}
  w_up = _weights(kw1, num_groups, f, d, FP8)
  w_down = _weights(kw2, num_groups, d, f, FP8)
  up_scale = jax.random.uniform(ks, (num_groups, f), jnp.float32, 0.002, 0.02)
  down_scale = jax.random.uniform(ks, (num_groups, d), jnp.float32, 0.002, 0.02)
  cases = []
  for regime, rows_list, goal in (
      ("prefill", prefill_rows, ">= 1.0x ragged_dot"),
      ("decode", decode_rows, ">= 1.0x ragged_dot, >= 70% of HBM bandwidth (weight-bound)")):
    for seed, num_rows in enumerate(rows_list):
      group_sizes = _group_sizes(num_rows, num_groups, seed)
      x_d = jax.random.normal(jax.random.fold_in(kx, num_rows), (num_rows, d)).astype(FP8)
      x_f = jax.random.normal(jax.random.fold_in(kx, num_rows + 100_000), (num_rows, f)).astype(FP8)
      x_scale = jax.random.uniform(jax.random.fold_in(ks, num_rows), (num_rows,), jnp.float32,
                                   0.5, 2.0)
      shape = f"A={num_rows} E={num_groups}"
      cases.append(_case(f"{regime} fp8 gate/up {shape} K={d} N={f} f32-out", x_d, w_up,
                         group_sizes, (x_scale, up_scale), jnp.float32, tol[jnp.float32], goal))
      if not toy:  # at toy shapes (K == N) it would repeat the gate/up case
        cases.append(_case(f"{regime} fp8 down {shape} K={f} N={d} f32-out", x_f, w_down,
                           group_sizes, (x_scale, down_scale), jnp.float32, tol[jnp.float32],
                           goal))
  # bf16 experts (no quantization), prefill gate/up: the weights are created here and freed with
  # the case (10.7 GB at Maverick shapes).
  num_rows = prefill_rows[0]
  w_bf16 = _weights(kw1, num_groups, f, d, jnp.bfloat16)
  x_bf16 = jax.random.normal(kx, (num_rows, d), jnp.bfloat16)
  cases.append(_case(f"prefill bf16 gate/up A={num_rows} E={num_groups} K={d} N={f} bf16-out",
                     x_bf16, w_bf16, _group_sizes(num_rows, num_groups, 0), (), jnp.bfloat16,
                     tol[jnp.bfloat16], ">= 1.0x ragged_dot"))
  return cases
