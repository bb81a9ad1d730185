"""Kernels are lowered once per distinct configuration (`common.lowered_once`), and the call-site
counter the lowering tests use counts every call of a shared kernel function."""

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import common
from pallas_kernels import gemm, grouped_gemm

# Hand-written: main calls @outer twice and @gemm once and has one kernel of its own; @outer
# calls @gemm twice and a kernel-free @plain.
TEXT = """module @m {
  func.func public @main(%a: tensor<2xf32>) -> tensor<2xf32> {
    %0 = call @outer(%a) : (tensor<2xf32>) -> tensor<2xf32>
    %1 = call @outer(%0) : (tensor<2xf32>) -> tensor<2xf32>
    %2 = call @gemm(%1) : (tensor<2xf32>) -> tensor<2xf32>
    %3 = stablehlo.custom_call @mosaic_gpu_v2(%2) : (tensor<2xbf16>) -> tensor<2xf32>
    return %3 : tensor<2xf32>
  }
  func.func private @outer(%a: tensor<2xf32>) -> tensor<2xf32> {
    %0 = call @gemm(%a) : (tensor<2xf32>) -> tensor<2xf32>
    %1 = call @gemm(%0) : (tensor<2xf32>) -> tensor<2xf32>
    %2 = call @plain(%1) : (tensor<2xf32>) -> tensor<2xf32>
    return %2 : tensor<2xf32>
  }
  func.func private @gemm(%a: tensor<2xf32>) -> tensor<2xf32> {
    %0 = stablehlo.custom_call @mosaic_gpu_v2(%a) : (tensor<2xf8E4M3FN>) -> tensor<2xf32>
    return %0 : tensor<2xf32>
  }
  func.func private @plain(%a: tensor<2xf32>) -> tensor<2xf32> {
    return %a : tensor<2xf32>
  }
}"""


def test_call_sites_of_a_hand_written_module():
  lines = common.mosaic_call_lines(TEXT)
  assert len(lines) == 1 + 1 + 2 * 2 == common.mosaic_call_sites(TEXT)
  assert sum("f8E4M3FN" in line for line in lines) == 5
  assert common.mosaic_call_sites(TEXT, entry="outer") == 2
  assert common.kernel_functions(TEXT) == {"main", "outer", "gemm"}


def test_repeated_kernel_calls_lower_to_one_definition():
  """Six FP8 GEMMs and two grouped GEMMs of one shape: one Mosaic module each in the text, eight
  calls. Without `lowered_once` the text holds one module per call (and JAX lowers each)."""
  S = jax.ShapeDtypeStruct
  n = 6

  def fn(x, ws, xs, wss, experts, sizes):
    y = x
    for i in range(n):
      y = gemm.gemm(y, ws[i], xs, wss[i], implementation="pallas").astype(jnp.float8_e4m3fn)
    for _ in range(2):
      y = grouped_gemm.grouped_matmul(y.astype(jnp.bfloat16), experts, sizes,
                                      implementation="pallas")
    return y

  args = (S((64, 512), jnp.float8_e4m3fn), S((n, 512, 512), jnp.float8_e4m3fn),
          S((64,), jnp.float32), S((n, 512), jnp.float32), S((4, 512, 512), jnp.bfloat16),
          S((4,), jnp.int32))
  for arch in ("sm90", "sm100"):
    text = pallas_kernels.lower_for_gpu(fn, *args, arch=arch)
    assert common.mosaic_call_sites(text) == n + 2, arch
    assert text.count("custom_call @mosaic_gpu") == 2, arch
