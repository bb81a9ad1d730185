"""MoE grouped GEMM (pallas_kernels.grouped_gemm): the Mosaic GPU kernel in GPU interpret mode
(race detection on) against a float64 NumPy reference, the schedule, lowering for sm_90 at
Maverick shapes, the XLA path and bad input.

Tolerances: bf16 and e4m3 products are exact in f32, so the kernel's only error is f32
accumulation order (~K * 2^-24 relative to the row's magnitude) plus the output rounding: f32
output within 1e-5 of the row's max |value|; bf16 output within 2^-8 of each value (one bf16
rounding, worst case: 8 significant bits) plus that 1e-5 of the row for the accumulation. (A
flat 2^-8 of the row's max left no room: measured up to 0.89 of it.)
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelInputError, common
from pallas_kernels.grouped_gemm import bench, grouped_matmul, grouped_swiglu
from pallas_kernels.grouped_gemm import schedule as sched_lib

FP8 = jnp.float8_e4m3fn
TOL = {jnp.dtype(jnp.float32): 1e-5}
BF16_EPS = 2.0 ** -8


def numpy_grouped_matmul(x, w, group_sizes, x_scale=None, w_scale=None):
  """float64: rows of group g times w[g]^T, times the scales; rows past the sum stay 0."""
  x = np.asarray(x, np.float64)
  w = np.asarray(w, np.float64)
  out = np.zeros((x.shape[0], w.shape[1]))
  start = 0
  for g, size in enumerate(np.asarray(group_sizes)):
    rows = slice(start, start + size)
    out[rows] = x[rows] @ w[g].T
    if x_scale is not None:
      out[rows] *= np.asarray(x_scale, np.float64)[rows, None]
      out[rows] *= np.asarray(w_scale, np.float64)[g][None, :]
    start += size
  return out


def make_inputs(seed, num_rows, k, n, group_sizes, dtype):
  rng = np.random.default_rng(seed)
  num_groups = len(group_sizes)
  x = jnp.asarray(rng.normal(size=(num_rows, k)), dtype)
  w = jnp.asarray(rng.normal(size=(num_groups, n, k)), dtype)
  scales = {}
  if dtype == FP8:
    scales = dict(x_scale=jnp.asarray(rng.uniform(0.5, 2.0, num_rows), jnp.float32),
                  w_scale=jnp.asarray(rng.uniform(0.01, 0.1, (num_groups, n)), jnp.float32))
  return x, w, jnp.asarray(group_sizes, jnp.int32), scales


def assert_rows_close(out, expected, out_dtype, f32_tol=None):
  out = np.asarray(out, np.float64)
  row_max = np.abs(expected).max(axis=1, keepdims=True)
  if jnp.dtype(out_dtype) == jnp.bfloat16:
    tol = BF16_EPS * np.abs(expected) + TOL[jnp.dtype(jnp.float32)] * row_max
  else:
    tol = (TOL[jnp.dtype(out_dtype)] if f32_tol is None else f32_tol) * np.maximum(row_max, 1e-30)
  bad = np.abs(out - expected) > tol
  assert not bad.any(), (f"{bad.sum()} elements off; worst row "
                         f"{np.argmax(bad.any(axis=1))}, max err {np.abs(out - expected).max()}")
  zero_rows = row_max[:, 0] == 0  # rows past sum(group_sizes): exactly 0, not garbage
  assert np.all(out[zero_rows] == 0)


def run_kernel(x, w, group_sizes, scales, out_dtype, arch="sm90"):
  with common.interpret(arch=arch):
    out = grouped_matmul(x, w, group_sizes, **scales, out_dtype=out_dtype,
                         implementation="pallas")
    return jax.block_until_ready(out)


# ---- the schedule (plain jnp, fast) ----

@pytest.mark.parametrize("num_rows,group_sizes,tile_m", [
    (70, [0, 1, 40, 0, 20], 64),  # tail of 9 zero rows, groups straddling blocks
    (64, [64], 64),
    (5, [0, 0, 5, 0], 64),
    (16, None, 64),  # E=128, 16 rows: more experts than tiles
    (300, [0, 1, 2, 3, 4, 5, 100, 185], 64),
])
def test_schedule_covers_each_row_once(num_rows, group_sizes, tile_m):
  if group_sizes is None:
    rng = np.random.default_rng(1)
    group_sizes = np.bincount(rng.integers(0, 128, num_rows), minlength=128)
  group_sizes = np.asarray(group_sizes)
  schedule = np.asarray(jax.jit(sched_lib.tile_schedule, static_argnums=(1, 2))(
      jnp.asarray(group_sizes, jnp.int32), num_rows, tile_m))
  assert schedule.shape == (4, sched_lib.padded_tiles(num_rows, len(group_sizes), tile_m))
  expected_group = np.full(num_rows, sched_lib.ZERO_GROUP)
  expected_group[:group_sizes.sum()] = np.repeat(np.arange(len(group_sizes)), group_sizes)
  owner = np.full(num_rows, -2)
  for group, block, lo, hi in schedule.T:
    for row in range(block * tile_m + lo, block * tile_m + hi):
      assert owner[row] == -2, f"row {row} owned twice"
      owner[row] = group
  np.testing.assert_array_equal(owner, expected_group)


# ---- the kernel in interpret mode ----

@pytest.mark.slow
@pytest.mark.parametrize("arch,dtype,out_dtype,n", [
    ("sm90", jnp.bfloat16, jnp.bfloat16, 192),  # N=192: three 64-wide N tiles
    ("sm90", FP8, jnp.float32, 128),
    ("sm100", FP8, jnp.bfloat16, 128), ("sm100", jnp.bfloat16, jnp.float32, 128)])
def test_odd_groups(arch, dtype, out_dtype, n):
  # A=70 not a multiple of the 64/128-row tile; groups of 0, 1 and odd sizes; 9 tail rows past
  # the sum; the 40-row group straddles a 64-row block boundary; K=256: two pipelined K steps.
  group_sizes = [0, 1, 40, 0, 21]
  x, w, gs, scales = make_inputs(0, 70, 256, n, group_sizes, dtype)
  out = run_kernel(x, w, gs, scales, out_dtype, arch)
  assert out.shape == (70, n) and out.dtype == out_dtype
  assert_rows_close(out, numpy_grouped_matmul(x, w, group_sizes, **scales), out_dtype)


def test_all_empty_but_one():
  # 100 experts, one non-empty: an 82-tile schedule, packed into two SMEM rows; 3 tail rows.
  group_sizes = [0] * 100
  group_sizes[73] = 77
  x, w, gs, scales = make_inputs(1, 80, 128, 128, group_sizes, FP8)
  out = run_kernel(x, w, gs, scales, jnp.float32)
  assert_rows_close(out, numpy_grouped_matmul(x, w, group_sizes, **scales), jnp.float32)


def test_many_experts_few_rows(arch="sm90"):
  # Decode-like: E=128 experts, 16 rows (more experts than tiles), groups from a fixed seed.
  rng = np.random.default_rng(2)
  group_sizes = np.bincount(rng.integers(0, 128, 16), minlength=128)
  x, w, gs, scales = make_inputs(2, 16, 128, 64, group_sizes, FP8)
  out = run_kernel(x, w, gs, scales, jnp.float32, arch)
  assert_rows_close(out, numpy_grouped_matmul(x, w, group_sizes, **scales), jnp.float32)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_bf16_weights_stored_k_by_n(arch):
  # maverick.moe's (E, K, N) layout, read as stored: the B tile is N-major (bf16 only).
  group_sizes = [0, 33, 20]
  x, w, gs, _ = make_inputs(8, 60, 128, 128, group_sizes, jnp.bfloat16)
  w_ekn = jnp.swapaxes(w, 1, 2)
  with common.interpret(arch=arch):
    out = grouped_matmul(x, w_ekn, gs, w_layout="ekn", out_dtype=jnp.float32,
                         implementation="pallas")
    fused = grouped_swiglu(x, w_ekn, w_ekn[::-1], gs, w_layout="ekn", out_dtype=jnp.float32,
                           implementation="pallas")
  assert_rows_close(out, numpy_grouped_matmul(x, w, group_sizes), jnp.float32)
  assert_rows_close(fused, numpy_swiglu(x, w, w[::-1], group_sizes), jnp.float32, f32_tol=1e-5)
  with pytest.raises(common.KernelInputError, match="K-major"):
    with common.interpret():
      grouped_matmul(x.astype(FP8), w_ekn.astype(FP8), gs, x_scale=jnp.ones(60),
                     w_scale=jnp.ones((3, 128)), w_layout="ekn", implementation="pallas")


def numpy_swiglu(x, w_gate, w_up, group_sizes, x_scale=None, gate_scale=None, up_scale=None):
  gate = numpy_grouped_matmul(x, w_gate, group_sizes, x_scale, gate_scale)
  up = numpy_grouped_matmul(x, w_up, group_sizes, x_scale, up_scale)
  return gate / (1.0 + np.exp(-gate)) * up


@pytest.mark.parametrize("arch,dtype,out_dtype", [
    ("sm90", FP8, jnp.bfloat16), ("sm90", jnp.bfloat16, jnp.float32), ("sm100", FP8, jnp.float32)])
def test_swiglu(arch, dtype, out_dtype):
  # Groups straddling the block, an empty one, 5 tail rows; silu(gate) * up in the epilogue.
  group_sizes = [30, 0, 35]
  x, w_gate, gs, scales = make_inputs(6, 70, 128, 64, group_sizes, dtype)
  _, w_up, _, up_scales = make_inputs(7, 70, 128, 64, group_sizes, dtype)
  kw = {}
  if scales:
    kw = dict(x_scale=scales["x_scale"], gate_scale=scales["w_scale"],
              up_scale=up_scales["w_scale"])
  with common.interpret(arch=arch):
    out = jax.block_until_ready(grouped_swiglu(x, w_gate, w_up, gs, **kw, out_dtype=out_dtype,
                                               implementation="pallas"))
  # silu(g) * u: exact-product accumulators, then a few f32 ops (exp, divide) per element.
  expected = numpy_swiglu(x, w_gate, w_up, group_sizes, kw.get("x_scale"), kw.get("gate_scale"),
                          kw.get("up_scale"))
  assert_rows_close(out, expected, out_dtype, f32_tol=1e-5)
  xla = grouped_swiglu(x, w_gate, w_up, gs, **kw, out_dtype=out_dtype, implementation="xla")
  assert_rows_close(xla, expected, out_dtype, f32_tol=1e-5)


def test_xla_path_matches_numpy():
  group_sizes = [3, 0, 7, 1]
  for dtype in (jnp.bfloat16, FP8):
    x, w, gs, scales = make_inputs(3, 12, 64, 64, group_sizes, dtype)
    out = grouped_matmul(x, w, gs, **scales, out_dtype=jnp.float32, implementation="xla")
    assert_rows_close(out, numpy_grouped_matmul(x, w, group_sizes, **scales), jnp.float32)


@pytest.mark.parametrize("group_sizes,safe", [
    # Sizes whose int32 sum overflows (it wrapped negative and crashed the kernel's schedule).
    ([2**31 - 1, 2**31 - 1, 5, 2**30], [20, 0, 0, 0]),
    # Negative sizes count as empty groups.
    ([-3, 7, -(2**31), 9], [0, 7, 0, 9]),
    # A total past the rows is cut at the rows.
    ([5, 12, 9, 1], [5, 12, 3, 0]),
], ids=["int32_overflow", "negative", "past_rows"])
def test_untrusted_group_sizes_are_made_safe_on_device(group_sizes, safe):
  """Group sizes are traced, so they cannot be checked on the host: both paths clamp each to
  [0, A] and cut the groups at A rows, the documented contract, matching float64 NumPy on the
  clamped sizes (rows past the total are exactly 0)."""
  num_rows = 20
  x, w, _, _ = make_inputs(4, num_rows, 64, 64, [1, 1, 1, 1], jnp.bfloat16)
  gs = jnp.asarray(np.array(group_sizes, np.int64).astype(np.int32))
  np.testing.assert_array_equal(np.asarray(sched_lib.safe_group_sizes(gs, num_rows)), safe)
  expected = numpy_grouped_matmul(x, w, safe)
  out_xla = grouped_matmul(x, w, gs, out_dtype=jnp.float32, implementation="xla")
  assert_rows_close(out_xla, expected, jnp.float32)
  assert_rows_close(run_kernel(x, w, gs, {}, jnp.float32), expected, jnp.float32)


def test_weight_only_fp8_falls_back_to_xla():
  group_sizes = [2, 3]
  x, _, gs, _ = make_inputs(4, 6, 128, 64, group_sizes, jnp.bfloat16)
  _, w, _, scales = make_inputs(4, 6, 128, 64, group_sizes, FP8)
  expected = numpy_grouped_matmul(x, w, group_sizes, np.ones(6), scales["w_scale"])
  with common.interpret():
    out = grouped_matmul(x, w, gs, w_scale=scales["w_scale"], out_dtype=jnp.float32)
    assert_rows_close(out, expected, jnp.float32)
    with pytest.raises(common.KernelInputError, match="bf16 x bf16"):
      grouped_matmul(x, w, gs, w_scale=scales["w_scale"], implementation="pallas")


# ---- lowering at Maverick shapes (Mosaic GPU layout inference + lowering on CPU) ----

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("arch,num_rows,k,n,dtype,out_dtype", [
    ("sm90", 8192, 5120, 8192, FP8, jnp.float32),  # prefill gate/up
    ("sm90", 8192, 8192, 5120, FP8, jnp.float32),  # prefill down
    ("sm90", 8192, 5120, 8192, jnp.bfloat16, jnp.bfloat16),
    ("sm90", 16, 5120, 8192, FP8, jnp.bfloat16),  # decode
    ("sm90", 16, 8192, 5120, jnp.bfloat16, jnp.float32),
    ("sm100", 8192, 5120, 8192, FP8, jnp.float32),
    ("sm100", 16, 8192, 5120, jnp.bfloat16, jnp.float32),
])
def test_lowers_for_gpu(arch, num_rows, k, n, dtype, out_dtype):
  num_groups = 128
  args = [S((num_rows, k), dtype), S((num_groups, n, k), dtype), S((num_groups,), jnp.int32)]
  if dtype == FP8:
    args += [S((num_rows,), jnp.float32), S((num_groups, n), jnp.float32)]
    fn = lambda x, w, g, xs, ws: grouped_matmul(x, w, g, x_scale=xs, w_scale=ws,
                                                out_dtype=out_dtype, implementation="pallas")
  else:
    fn = lambda x, w, g: grouped_matmul(x, w, g, out_dtype=out_dtype, implementation="pallas")
  text = common.lower_for_gpu(fn, *args, arch=arch)
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("num_rows", [16, 8192])
def test_k_by_n_weights_lower_for_gpu(arch, num_rows):
  # bf16 experts as maverick.moe stores them, (E, K, N): fused gate/up, then down.
  num_groups, d, f = 128, 5120, 8192
  x, g = S((num_rows, d), jnp.bfloat16), S((num_groups,), jnp.int32)
  w_up = S((num_groups, d, f), jnp.bfloat16)
  text = common.lower_for_gpu(
      lambda x, w, g: grouped_swiglu(x, w, w, g, w_layout="ekn", implementation="pallas"),
      x, w_up, g, arch=arch)
  assert "mosaic_gpu" in text
  h, w_down = S((num_rows, f), jnp.bfloat16), S((num_groups, f, d), jnp.bfloat16)
  text = common.lower_for_gpu(
      lambda h, w, g: grouped_matmul(h, w, g, w_layout="ekn", out_dtype=jnp.float32,
                                     implementation="pallas"), h, w_down, g, arch=arch)
  assert "mosaic_gpu" in text


@pytest.mark.parametrize("arch,num_rows,dtype,out_dtype", [
    ("sm90", 8192, FP8, jnp.bfloat16), ("sm90", 8192, jnp.bfloat16, jnp.float32),
    ("sm90", 16, FP8, jnp.float32), ("sm100", 8192, FP8, jnp.bfloat16),
    ("sm100", 8192, jnp.bfloat16, jnp.float32)])
def test_swiglu_lowers_for_gpu(arch, num_rows, dtype, out_dtype):
  # Two (E, F, K) weights and two accumulators: the largest SMEM/register footprint.
  num_groups, k, n = 128, 5120, 8192
  w = S((num_groups, n, k), dtype)
  args = [S((num_rows, k), dtype), w, w, S((num_groups,), jnp.int32)]
  if dtype == FP8:
    args += [S((num_rows,), jnp.float32), S((num_groups, n), jnp.float32),
             S((num_groups, n), jnp.float32)]
    fn = lambda x, wg, wu, g, xs, gs, us: grouped_swiglu(
        x, wg, wu, g, x_scale=xs, gate_scale=gs, up_scale=us, out_dtype=out_dtype,
        implementation="pallas")
  else:
    fn = lambda x, wg, wu, g: grouped_swiglu(x, wg, wu, g, out_dtype=out_dtype,
                                             implementation="pallas")
  assert "mosaic_gpu" in common.lower_for_gpu(fn, *args, arch=arch)


# ---- bad input ----

def _bad(**overrides):
  x, w, gs, scales = make_inputs(5, 8, 128, 64, [3, 5], FP8)
  kwargs = dict(x=x, w=w, group_sizes=gs, **scales)
  kwargs.update(overrides)
  return kwargs


@pytest.mark.parametrize("overrides,match", [
    (dict(x=jnp.zeros((8, 128), jnp.bfloat16), w=jnp.zeros((2, 64, 128), jnp.float32)),
     "differ"),
    (dict(x=jnp.zeros((8, 128), FP8), w=jnp.zeros((2, 64, 128), jnp.bfloat16)), "differ"),
    (dict(w_scale=jnp.ones((2, 32), jnp.float32)), "w_scale"),
    (dict(x_scale=jnp.ones((7,), jnp.float32)), "x_scale"),
    (dict(group_sizes=jnp.ones((3,), jnp.int32)), "group_sizes"),
    (dict(group_sizes=jnp.ones((2,), jnp.float32)), "integer"),
    (dict(w=jnp.zeros((2, 64, 96), FP8)), "K=96"),
    (dict(x=jnp.zeros((8, 128, 1), FP8)), "x:"),
])
def test_bad_input_raises(overrides, match):
  with pytest.raises(common.KernelInputError, match=match):
    grouped_matmul(**_bad(**overrides))


def test_kernel_alignment_raises_for_pallas():
  kwargs = _bad(x=jnp.zeros((8, 96), FP8), w=jnp.zeros((2, 64, 96), FP8))
  with common.interpret():
    with pytest.raises(common.KernelInputError, match="multiple of 128"):
      grouped_matmul(**kwargs, implementation="pallas")
    with pytest.raises(common.KernelInputError, match="multiple of 64"):
      grouped_matmul(**_bad(w=jnp.zeros((2, 96, 128), FP8),
                            w_scale=jnp.ones((2, 96), jnp.float32)), implementation="pallas")
  out = grouped_matmul(**kwargs)  # auto: XLA
  assert out.shape == (8, 64)


def test_swiglu_bad_input_raises():
  kw = _bad()
  x, w, gs = kw["x"], kw["w"], kw["group_sizes"]
  with pytest.raises(common.KernelInputError, match="w_up"):
    grouped_swiglu(x, w, w[:, :32], gs, x_scale=kw["x_scale"], gate_scale=kw["w_scale"],
                   up_scale=kw["w_scale"][:, :32])
  with pytest.raises(common.KernelInputError, match="both"):
    grouped_swiglu(x, w, w, gs, x_scale=kw["x_scale"], gate_scale=kw["w_scale"])


def test_no_rows():
  x, w, gs, scales = make_inputs(8, 0, 128, 64, [0, 0], FP8)
  with common.interpret():
    out = grouped_matmul(x, w, gs, **scales, implementation="pallas")
  assert out.shape == (0, 64)


def test_bad_out_dtype_and_implementation():
  with pytest.raises(common.KernelInputError, match="out_dtype"):
    grouped_matmul(**_bad(), out_dtype=jnp.int8)
  with pytest.raises(common.KernelInputError, match="implementation"):
    grouped_matmul(**_bad(), implementation="triton")


@pytest.mark.slow
def test_bench_toy_cases_match_reference():
  with common.interpret():
    for case in bench.benchmark_cases(toy=True):
      out = np.asarray(case.kernel(*case.args), np.float64)
      ref = np.asarray(case.reference(*case.args), np.float64)
      rel = np.abs(out - ref).max() / np.abs(ref).max()
      assert rel <= case.max_rel_error, (case.name, rel)


# ---- rows in any order, each with its own group (decode: no sort by expert) ----

def numpy_rows(x, w, row_groups, x_scale=None, w_scale=None):
  """float64: row a times w[row_groups[a]]^T and the scales; a group outside [0, E) gives 0."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  out = np.zeros((x.shape[0], w.shape[1]))
  for a, g in enumerate(np.asarray(row_groups)):
    if 0 <= g < w.shape[0]:
      out[a] = x[a] @ w[g].T
      if x_scale is not None:
        out[a] *= np.asarray(x_scale, np.float64)[a] * np.asarray(w_scale, np.float64)[g]
  return out


# E = 80 experts. Unsorted rows with repeated groups and a group past E (another shard's expert:
# a zero row); one row; 66 rows: the first and last rows of a 64-row block (sm90's tile), the
# first row of the next block, and a zero row there.
ROW_CASES = {"unsorted": [5, 2, 5, 9, 0, 2, 85], "one_row": [3],
             "two_blocks": list(range(63, -1, -1)) + [1, 85]}


@pytest.mark.parametrize("arch,dtype,out_dtype", [
    ("sm90", FP8, jnp.float32), ("sm90", jnp.bfloat16, jnp.bfloat16),
    ("sm100", FP8, jnp.bfloat16)])
@pytest.mark.parametrize("case", sorted(ROW_CASES))
def test_row_groups_in_any_order(arch, dtype, out_dtype, case):
  row_groups = np.asarray(ROW_CASES[case])
  x, w, _, scales = make_inputs(11, len(row_groups), 128, 64, [0] * 80, dtype)
  rg = jnp.asarray(row_groups, jnp.int32)
  expected = numpy_rows(x, w, row_groups, **scales)
  with common.interpret(arch=arch):
    out = jax.block_until_ready(grouped_matmul(x, w, row_groups=rg, **scales,
                                               out_dtype=out_dtype, implementation="pallas"))
  assert_rows_close(out, expected, out_dtype)
  xla = grouped_matmul(x, w, row_groups=rg, **scales, out_dtype=out_dtype, implementation="xla")
  assert_rows_close(xla, expected, out_dtype)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_row_groups_swiglu(arch):
  row_groups = np.asarray([7, 1, 7, 130, 4])  # 130: past the 8 experts, a zero row
  x, w_gate, _, scales = make_inputs(21, 5, 256, 64, [0] * 8, FP8)
  _, w_up, _, up_scales = make_inputs(22, 5, 256, 64, [0] * 8, FP8)
  kw = dict(x_scale=scales["x_scale"], gate_scale=scales["w_scale"], up_scale=up_scales["w_scale"])
  gate = numpy_rows(x, w_gate, row_groups, scales["x_scale"], scales["w_scale"])
  up = numpy_rows(x, w_up, row_groups, scales["x_scale"], up_scales["w_scale"])
  expected = gate / (1.0 + np.exp(-gate)) * up
  rg = jnp.asarray(row_groups, jnp.int32)
  with common.interpret(arch=arch):
    out = jax.block_until_ready(grouped_swiglu(x, w_gate, w_up, row_groups=rg, **kw,
                                               out_dtype=jnp.float32, implementation="pallas"))
  assert_rows_close(out, expected, jnp.float32, f32_tol=1e-5)
  xla = grouped_swiglu(x, w_gate, w_up, row_groups=rg, **kw, out_dtype=jnp.float32,
                       implementation="xla")
  assert_rows_close(xla, expected, jnp.float32, f32_tol=1e-5)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_row_weights_scale_each_routed_rows_products(arch):
  """The router's score per routed row (`row_weights`), applied to the gate and up products
  before the SwiGLU (as if it scaled the input row), on x padded past the routed rows (decode:
  1 and 3 routed rows of a tile); the padding rows stay 0."""
  num_rows = 128 if arch == "sm100" else 64
  for seed, row_groups in ((41, np.asarray([5])), (42, np.asarray([2, 9, 6]))):
    x, w_gate, _, scales = make_inputs(seed, num_rows, 256, 64, [0] * 8, FP8)
    _, w_up, _, up_scales = make_inputs(seed + 100, num_rows, 256, 64, [0] * 8, FP8)
    weights = np.random.default_rng(seed).uniform(0.1, 0.9, len(row_groups)).astype(np.float32)
    kw = dict(x_scale=scales["x_scale"], gate_scale=scales["w_scale"],
              up_scale=up_scales["w_scale"], row_weights=jnp.asarray(weights))
    pad = np.full(num_rows - len(row_groups), -1)
    row_scale = np.asarray(scales["x_scale"], np.float64).copy()
    row_scale[:len(row_groups)] *= weights
    gate = numpy_rows(x, w_gate, np.concatenate([row_groups, pad]), row_scale, scales["w_scale"])
    up = numpy_rows(x, w_up, np.concatenate([row_groups, pad]), row_scale, up_scales["w_scale"])
    expected = gate / (1.0 + np.exp(-gate)) * up
    rg = jnp.asarray(row_groups, jnp.int32)
    with common.interpret(arch=arch):
      out = jax.block_until_ready(grouped_swiglu(x, w_gate, w_up, row_groups=rg, **kw,
                                                 out_dtype=jnp.float32, implementation="pallas"))
    assert_rows_close(out, expected, jnp.float32, f32_tol=1e-5)
    assert np.all(np.asarray(out)[len(row_groups):] == 0)
    xla = grouped_swiglu(x, w_gate, w_up, row_groups=rg, **kw, out_dtype=jnp.float32,
                         implementation="xla")
    assert_rows_close(xla, expected, jnp.float32, f32_tol=1e-5)
  with pytest.raises(KernelInputError, match="row_weights"):
    grouped_swiglu(x, w_gate, w_up, row_groups=rg, **dict(kw, row_weights=jnp.ones((2,))))


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_row_groups_for_the_first_rows_of_a_padded_x(arch):
  # The caller padded x to the row tile before quantizing: 5 routed rows, then padding rows of
  # nonzero junk that must come out 0 (one zero-group tile per block of the tail: 2 blocks).
  row_groups = np.asarray([3, 0, 3, 40, 6])  # 40: past the 8 experts, a zero row
  num_rows = 130 if arch == "sm100" else 70
  x, w, _, scales = make_inputs(31, num_rows, 128, 64, [0] * 8, FP8)
  expected = numpy_rows(x, w, np.concatenate([row_groups, np.full(num_rows - 5, -1)]), **scales)
  rg = jnp.asarray(row_groups, jnp.int32)
  with common.interpret(arch=arch):
    out = jax.block_until_ready(grouped_matmul(x, w, row_groups=rg, **scales,
                                               out_dtype=jnp.float32, implementation="pallas"))
  assert_rows_close(out, expected, jnp.float32)
  assert np.all(np.asarray(out)[5:] == 0) and np.abs(np.asarray(out)[:3]).min() > 0
  xla = grouped_matmul(x, w, row_groups=rg, **scales, out_dtype=jnp.float32, implementation="xla")
  assert_rows_close(xla, expected, jnp.float32)


def test_row_schedule_gives_each_row_its_own_tile():
  sched = np.asarray(sched_lib.row_schedule(jnp.asarray([4, -1, 9, 4, 2]), 9, 64))
  assert sched.shape == (4, sched_lib.padded_tiles(5, 9, 64))
  group, block, lo, hi = sched
  np.testing.assert_array_equal(group[:5], [4, sched_lib.ZERO_GROUP, sched_lib.ZERO_GROUP, 4, 2])
  np.testing.assert_array_equal(lo[:5], np.arange(5))
  np.testing.assert_array_equal(hi[:5], np.arange(1, 6))
  np.testing.assert_array_equal(block[:5], 0)
  assert (lo[5:] == hi[5:]).all()  # unused tiles own no rows
  # x padded to 140 rows: the tail [5, 140) is one zero tile per 64-row block it touches
  group, block, lo, hi = np.asarray(sched_lib.row_schedule(jnp.asarray([4, -1, 9, 4, 2]), 9, 64,
                                                           num_rows=140))
  np.testing.assert_array_equal(group[5:8], sched_lib.ZERO_GROUP)
  np.testing.assert_array_equal(block[5:8], [0, 1, 2])
  np.testing.assert_array_equal(lo[5:8], [5, 0, 0])
  np.testing.assert_array_equal(hi[5:8], [64, 64, 12])
  assert (lo[8:] == hi[8:]).all()


def test_row_groups_bad_input_raises():
  x, w, gs, scales = make_inputs(5, 8, 128, 64, [3, 5], FP8)
  rg = jnp.zeros((8,), jnp.int32)
  with pytest.raises(common.KernelInputError, match="not both"):
    grouped_matmul(x, w, gs, row_groups=rg, **scales)
  with pytest.raises(common.KernelInputError, match="not both and not neither"):
    grouped_matmul(x, w, **scales)
  with pytest.raises(common.KernelInputError, match=r"row_groups: expected shape \(A',\) with "
                     r"A' <= 8"):
    grouped_matmul(x, w, row_groups=jnp.zeros((9,), jnp.int32), **scales)
  with pytest.raises(common.KernelInputError, match="at most E \\+ 1 rows"):
    grouped_matmul(x, w, row_groups=rg, **scales)  # 8 rows over 2 groups
