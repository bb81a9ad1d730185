"""pallas_kernels.gemm: the Hopper kernel in GPU interpret mode (races detected) against float64
NumPy, its lowering to Mosaic GPU at Maverick shapes, the XLA path, and bad input.

Tolerance: the inputs (bf16 or e4m3) and scales are exact in float64, the kernel accumulates in
f32 (relative error ~K * 2^-24 of sum |x||w|, negligible here) and rounds the output to bf16 once
(relative error <= 2^-9). So |out - ref| <= 2^-8 |ref| + 1e-5 * (|x| @ |w|.T) * scales."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import KernelInputError, gemm as gemm_lib
from pallas_kernels.gemm import sm90

FP8 = jnp.float8_e4m3fn
S = jax.ShapeDtypeStruct


def _inputs(seed, m, n, k, dtype, scaled):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(m, k)) * 2, dtype)
  w = jnp.asarray(rng.normal(size=(n, k)), dtype)
  xs = jnp.asarray(rng.uniform(0.01, 2, size=m), jnp.float32) if scaled else None
  ws = jnp.asarray(rng.uniform(0.01, 2, size=n), jnp.float32) if scaled else None
  return x, w, xs, ws


def _reference(x, w, xs, ws):
  xf, wf = np.asarray(x, np.float64), np.asarray(w, np.float64)
  ref, mag = xf @ wf.T, np.abs(xf) @ np.abs(wf).T
  if xs is not None:
    scale = np.asarray(xs, np.float64)[:, None] * np.asarray(ws, np.float64)[None, :]
    ref, mag = ref * scale, mag * scale
  return ref, mag


def _check(out, ref, mag):
  out = np.asarray(out, np.float64)
  assert out.shape == ref.shape
  bound = 2.0 ** -8 * np.abs(ref) + 1e-5 * mag
  worst = np.max(np.abs(out - ref) - bound)
  assert worst <= 0, f"exceeds the bf16 bound by {worst}"


@pytest.mark.slow
@pytest.mark.parametrize("m,n,k,dtype,scaled,config", [
    (1, 128, 256, FP8, True, None),  # decode, one token: 63 padding rows
    (5, 96, 384, FP8, True, None),  # odd M; N a multiple of 32 only (narrow tiles)
    (70, 128, 256, FP8, True, None),  # just past one 64-row tile: a second, mostly padding
    (64, 128, 512, FP8, True, sm90.Config(64, 64, 128, 2, "n", k_splits=2)),  # split-K
    (130, 128, 256, FP8, True, sm90.Config(64, 64, 128, 2, "m")),  # WGs split M, 3 CTA rows
    (3, 128, 128, jnp.bfloat16, False, None),  # the bf16 path
    (9, 64, 256, FP8, False, None),  # FP8 without scales
    (7, 48, 96, FP8, True, None),  # N a multiple of 16 only, K of 32 only (narrow tiles)
])
def test_kernel_matches_float64(m, n, k, dtype, scaled, config):
  x, w, xs, ws = _inputs(m * 7 + n, m, n, k, dtype, scaled)
  with pallas_kernels.interpret():
    out = gemm_lib.gemm(x, w, xs, ws, implementation="pallas", config=config)
  assert out.dtype == jnp.bfloat16
  _check(out, *_reference(x, w, xs, ws))


@pytest.mark.parametrize("m,n,k,dtype,scaled", [
    (5, 128, 256, FP8, True),  # decode: 123 padding rows of a 128-row tile
    (130, 256, 384, FP8, True),  # two M tiles, three K steps
    (3, 128, 128, jnp.bfloat16, False),
])
def test_blackwell_kernel_matches_float64(m, n, k, dtype, scaled):
  x, w, xs, ws = _inputs(m * 5 + k, m, n, k, dtype, scaled)
  with pallas_kernels.interpret(arch="sm100"):  # tcgen05 + TMEM, simulated
    out = gemm_lib.gemm(x, w, xs, ws, implementation="pallas")
  _check(out, *_reference(x, w, xs, ws))


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("m,n,k", [(3, 96, 48), (70, 64, 128)])
def test_bf16_weights_stored_k_by_n(m, n, k, arch):
  x, w, _, _ = _inputs(m + n + k, m, n, k, jnp.bfloat16, False)
  with pallas_kernels.interpret(arch=arch):
    out = gemm_lib.gemm(x, w.T, w_layout="kn", implementation="pallas")
  _check(out, *_reference(x, w, None, None))


def test_one_scale_and_leading_axes():
  x, w, xs, _ = _inputs(3, 6, 64, 128, FP8, True)
  x3, xs3 = x.reshape(2, 3, 128), xs.reshape(2, 3)
  with pallas_kernels.interpret():
    out = gemm_lib.gemm(x3, w, xs3, None, implementation="pallas", out_dtype=jnp.float32)
  assert out.shape == (2, 3, 64) and out.dtype == jnp.float32
  ref, mag = _reference(x, w, None, None)
  ref, mag = ref * np.asarray(xs, np.float64)[:, None], mag * np.asarray(xs, np.float64)[:, None]
  np.testing.assert_allclose(np.asarray(out, np.float64).reshape(6, 64), ref, rtol=1e-5,
                             atol=1e-6 * mag.max())


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_keep_row_padding_returns_the_tile_rows(implementation):
  """keep_row_padding: [M_pad, N] with the product in the first M rows (the kernel's 64-row tile
  on the kernel path, M itself on XLA's); leading axes flattened."""
  x, w, xs, ws = _inputs(4, 6, 64, 128, FP8, True)
  with pallas_kernels.interpret():
    out = gemm_lib.gemm(x.reshape(2, 3, 128), w, xs.reshape(2, 3), ws,
                        implementation=implementation, keep_row_padding=True)
  assert out.shape == ((64 if implementation == "pallas" else 6), 64)
  _check(out[:6], *_reference(x, w, xs, ws))


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("m,ns,k,dtype,scaled", [
    (3, (256, 128, 128), 256, FP8, True),  # q, k, v of a decode step: one launch
    (5, (64, 64), 128, jnp.bfloat16, False),  # gate and up, bf16
])
def test_gemm_many_matches_float64(arch, m, ns, k, dtype, scaled):
  """Several weights over one x in one kernel: each output its own product (a tile routed to
  the wrong weight or the wrong columns of its weight shows); one Mosaic call when lowered."""
  rng = np.random.default_rng(sum(ns) + m)
  x, _, xs, _ = _inputs(m + k, m, 16, k, dtype, scaled)
  ws = [jnp.asarray(rng.normal(size=(n, k)), dtype) for n in ns]
  w_scales = ([jnp.asarray(rng.uniform(0.01, 2, size=n), jnp.float32) for n in ns]
              if scaled else None)
  with pallas_kernels.interpret(arch=arch):
    outs = gemm_lib.gemm_many(x, ws, xs, w_scales, implementation="pallas")
  assert len(outs) == len(ns)
  for i, (out, w) in enumerate(zip(outs, ws)):
    _check(out, *_reference(x, w, xs, None if w_scales is None else w_scales[i]))
  text = pallas_kernels.lower_for_gpu(
      lambda x, *ws: gemm_lib.gemm_many(x, ws, implementation="pallas"),
      jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
      *[jax.ShapeDtypeStruct((n, k), jnp.bfloat16) for n in ns], arch=arch)
  assert text.count("mosaic_gpu_v2(") == 1


def test_gemm_many_with_a_k_split_and_bad_input():
  """A K split: per-weight f32 partials reduced and scaled after the kernel."""
  x, _, xs, _ = _inputs(11, 4, 16, 512, FP8, True)
  rng = np.random.default_rng(12)
  ws = [jnp.asarray(rng.normal(size=(n, 512)), FP8) for n in (128, 256)]
  w_scales = [jnp.asarray(rng.uniform(0.01, 2, size=n), jnp.float32) for n in (128, 256)]
  with pallas_kernels.interpret():
    outs = gemm_lib.gemm_many(x, ws, xs, w_scales, implementation="pallas",
                              config=sm90.Config(64, 64, 128, 2, "n", k_splits=2))
  for out, w, s in zip(outs, ws, w_scales):
    _check(out, *_reference(x, w, xs, s))
  with pytest.raises(pallas_kernels.KernelInputError, match="1 w_scales for 2 weights"):
    gemm_lib.gemm_many(x, ws, xs, w_scales[:1])
  with pytest.raises(pallas_kernels.KernelInputError, match="same dtype"):
    gemm_lib.gemm_many(x, [ws[0], ws[1].astype(jnp.bfloat16)], xs, w_scales)


def test_xla_path_and_auto_on_cpu():
  x, w, xs, ws = _inputs(11, 7, 64, 128, FP8, True)
  ref, mag = _reference(x, w, xs, ws)
  for impl in ("xla", None):  # auto is XLA without a GPU
    out = gemm_lib.gemm(x, w, xs, ws, implementation=impl, out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(out, np.float64), ref, rtol=1e-5, atol=1e-6 * mag.max())


@pytest.mark.parametrize("m,n,k,dtype", [
    (16, 5120, 5120, FP8),  # decode: q/k/v/o-sized projection, split-K
    (64, 16384, 5120, FP8),  # decode: dense MLP gate/up
    (4, 202048, 5120, jnp.bfloat16),  # LM head (N a multiple of 32, not 128)
    (4096, 8192, 5120, FP8),  # prefill
    (4096, 5120, 8192, jnp.bfloat16),  # prefill, bf16
    (1000, 5120, 5120, FP8),  # prefill, M not a tile multiple
    (16, 128, 5120, jnp.bfloat16),  # w stored (K, N) below: the model's bf16 layout
])
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_lowers_to_mosaic_gpu_at_maverick_shapes(m, n, k, dtype, arch):
  scaled = dtype == FP8
  args = (S((m, k), dtype), S((n, k), dtype), S((m,), jnp.float32) if scaled else None,
          S((n,), jnp.float32) if scaled else None)
  layout = "kn" if n == 128 else "nk"
  if layout == "kn":
    args = (args[0], S((k, n), dtype), None, None)
  hlo = pallas_kernels.lower_for_gpu(
      lambda x, w, xs, ws: gemm_lib.gemm(x, w, xs, ws, w_layout=layout, implementation="pallas"),
      *args, arch=arch)
  assert "mosaic_gpu" in hlo


def test_bad_input():
  x, w, xs, ws = _inputs(1, 4, 64, 128, FP8, True)
  with pytest.raises(KernelInputError, match="disagree on K"):
    gemm_lib.gemm(x, w[:, :64])
  with pytest.raises(KernelInputError, match="x_scale has shape"):
    gemm_lib.gemm(x, w, xs[:3], ws)
  with pytest.raises(KernelInputError, match=r"w_scale has shape \(4,\)"):
    gemm_lib.gemm(x, w, xs, xs)
  with pytest.raises(KernelInputError, match="implementation='cuda'"):
    gemm_lib.gemm(x, w, implementation="cuda")
  with pytest.raises(KernelInputError, match="interpret"):  # no GPU here
    gemm_lib.gemm(x, w, xs, ws, implementation="pallas")
  with pallas_kernels.interpret():
    with pytest.raises(KernelInputError, match="e4m3 x e4m3"):
      gemm_lib.gemm(x.astype(jnp.bfloat16), w, None, ws, implementation="pallas")
    with pytest.raises(KernelInputError, match="K=80 must be a multiple of 32"):
      gemm_lib.gemm(x[:, :80], w[:, :80], xs, ws, implementation="pallas")
    with pytest.raises(KernelInputError, match="N=40 must be a multiple of 16"):
      gemm_lib.gemm(x, w[:40], xs, ws[:40], implementation="pallas")
    with pytest.raises(KernelInputError, match="K-major"):
      gemm_lib.gemm(x, w.T, xs, ws, w_layout="kn", implementation="pallas")
    # auto falls back to XLA where the kernel cannot go
    out = gemm_lib.gemm(x.astype(jnp.bfloat16), w, None, ws)
    assert out.shape == (4, 64)
