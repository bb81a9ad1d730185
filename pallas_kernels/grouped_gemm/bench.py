"""Benchmark cases for benchmarks/kernels.py: the MoE expert projections of Llama 4 Maverick.

Prefill: A=8192 tokens routed top-1 over E=128 experts with uneven (Dirichlet) loads from a fixed
seed; decode: A=16 and 64. FP8 e4m3 with per-row and per-channel scales: up (K=D=5120,
N=F=8192) and down (K=8192, N=5120) with f32 output (what the model consumes today), and the
fused swiglu(gate, up) with bf16 output; plus bf16 up at prefill. Baselines: `jax.lax.ragged_dot`
(same dtypes, f32 preferred, then scaled); for swiglu two of them and silu * up.
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

  def run(implementation):
    def fn(x, w, g, *s):
      kw = dict(x_scale=s[0], w_scale=s[1]) if s else {}
      return api.grouped_matmul(x, w, g, **kw, out_dtype=out_dtype,
                                implementation=implementation)
    return fn

  out_bytes = num_rows * n * jnp.dtype(out_dtype).itemsize
  return common.BenchCase(
      op="grouped_gemm", name=name, args=(x, w, group_sizes, *scales), kernel=run("pallas"),
      reference=run("xla"),
      baselines={"ragged_dot": functools.partial(_ragged_dot_baseline, out_dtype=out_dtype)},
      flops=2.0 * num_rows * n * k,
      bytes=float(used_experts * n * k * w.dtype.itemsize + x.size * x.dtype.itemsize
                  + out_bytes),
      max_rel_error=max_rel_error, goal=goal)


def _swiglu_case(name, x, w_gate, w_up, group_sizes, scales, out_dtype, max_rel_error, goal):
  num_rows, k = x.shape
  num_groups, n, _ = w_gate.shape
  used_experts = int(jnp.sum(group_sizes > 0))

  def run(implementation):
    return lambda x, wg, wu, g, xs, gs, us: api.grouped_swiglu(
        x, wg, wu, g, x_scale=xs, gate_scale=gs, up_scale=us, out_dtype=out_dtype,
        implementation=implementation)

  def baseline(x, wg, wu, g, xs, gs, us):  # two ragged_dots, then silu * up
    gate = _ragged_dot_baseline(x, wg, g, xs, gs, out_dtype=jnp.float32)
    up = _ragged_dot_baseline(x, wu, g, xs, us, out_dtype=jnp.float32)
    return (jax.nn.silu(gate) * up).astype(out_dtype)

  return common.BenchCase(
      op="grouped_gemm", name=name, args=(x, w_gate, w_up, group_sizes, *scales),
      kernel=run("pallas"), reference=run("xla"), baselines={"ragged_dot x2 + silu": baseline},
      flops=2.0 * 2 * num_rows * n * k,
      bytes=float(2 * used_experts * n * k * w_gate.dtype.itemsize
                  + x.size * x.dtype.itemsize + num_rows * n * jnp.dtype(out_dtype).itemsize),
      max_rel_error=max_rel_error, goal=goal)


class _Random:
  """Inputs from fixed seeds: NumPy at toy shapes (no compiles), jax.random on the device at
  Maverick shapes (GBs of weights)."""

  def __init__(self, toy):
    self.toy = toy
    self.seed = 0

  def normal(self, shape, dtype, scale=1.0):
    return self._draw(shape, dtype, "normal", scale, 0.0)

  def uniform(self, shape, low, high):
    return self._draw(shape, jnp.float32, "uniform", low, high)

  def _draw(self, shape, dtype, kind, a, b):
    self.seed += 1
    if self.toy:
      rng = np.random.default_rng(self.seed)
      values = rng.normal(size=shape) * a if kind == "normal" else rng.uniform(a, b, size=shape)
      return jnp.asarray(values, dtype)
    return _device_draw(jax.random.key(self.seed), tuple(shape), jnp.dtype(dtype), kind, a, b)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5))
def _device_draw(key, shape, dtype, kind, a, b):
  if kind == "normal":
    return (jax.random.normal(key, shape, jnp.float32) * a).astype(dtype)
  return jax.random.uniform(key, shape, jnp.float32, a, b).astype(dtype)


def benchmark_cases(toy: bool) -> list[common.BenchCase]:
  rand = _Random(toy)
  if toy:
    num_groups, d, f = 4, 128, 128
    prefill_rows, decode_rows = (40,), (5,)
  else:
    num_groups, d, f = 128, 5120, 8192
    prefill_rows, decode_rows = (8192,), (16, 64)
  # f32 out: only accumulation order differs from XLA; bf16 out adds one output rounding.
  tol = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}
  w_gate = rand.normal((num_groups, f, d), FP8)
  w_up = rand.normal((num_groups, f, d), FP8)
  w_down = rand.normal((num_groups, d, f), FP8)
  gate_scale = rand.uniform((num_groups, f), 0.002, 0.02)
  up_scale = rand.uniform((num_groups, f), 0.002, 0.02)
  down_scale = rand.uniform((num_groups, d), 0.002, 0.02)
  cases = []
  for regime, rows_list, goal in (
      ("prefill", prefill_rows, ">= 1.0x ragged_dot"),
      ("decode", decode_rows, ">= 1.0x ragged_dot, >= 70% of HBM bandwidth (weight-bound)")):
    for seed, num_rows in enumerate(rows_list):
      group_sizes = _group_sizes(num_rows, num_groups, seed)
      x_d = rand.normal((num_rows, d), FP8)
      x_f = rand.normal((num_rows, f), FP8)
      x_scale = rand.uniform((num_rows,), 0.5, 2.0)
      shape = f"A={num_rows} E={num_groups}"
      cases.append(_case(f"{regime} fp8 up {shape} K={d} N={f} f32-out", x_d, w_up,
                         group_sizes, (x_scale, up_scale), jnp.float32, tol[jnp.float32], goal))
      if not toy or regime == "prefill":  # toy: keep interpret-mode runs few
        cases.append(_swiglu_case(
            f"{regime} fp8 swiglu(gate, up) {shape} K={d} F={f} bf16-out", x_d, w_gate, w_up,
            group_sizes, (x_scale, gate_scale, up_scale), jnp.bfloat16, tol[jnp.bfloat16], goal))
      if not toy:  # at toy shapes (K == N) it would repeat the up case
        cases.append(_case(f"{regime} fp8 down {shape} K={f} N={d} f32-out", x_f, w_down,
                           group_sizes, (x_scale, down_scale), jnp.float32, tol[jnp.float32],
                           goal))
  # bf16 experts (no quantization), prefill: 10.7 GB more weights at Maverick shapes.
  num_rows = prefill_rows[0]
  w_bf16 = rand.normal((num_groups, f, d), jnp.bfloat16)
  x_bf16 = rand.normal((num_rows, d), jnp.bfloat16)
  cases.append(_case(f"prefill bf16 up A={num_rows} E={num_groups} K={d} N={f} bf16-out",
                     x_bf16, w_bf16, _group_sizes(num_rows, num_groups, 0), (), jnp.bfloat16,
                     tol[jnp.bfloat16], ">= 1.0x ragged_dot"))
  return cases
