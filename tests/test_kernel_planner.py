"""The resource planners (pallas_kernels/*/plan.py): their SMEM/TMEM counts against what Mosaic GPU
allocates, the GEMM shapes that used to exceed sm_90 SMEM, and that the SMEM check is what keeps
them lowering."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu import core as mosaic_core

import pallas_kernels
from maverick import kernel_sweep as ks
from pallas_kernels import gemm, resources
from pallas_kernels.gemm import plan as gemm_plan

FP8 = jnp.float8_e4m3fn
# The shapes of the issue: FP8 GEMMs at M 129..1000 that failed with smem_bytes=280656 on sm90.
FORMER_FAILURES_NK = ((5120, 5120), (1024, 5120), (640, 5120), (128, 5120), (2048, 5120),
                      (16384, 5120), (5120, 16384), (5120, 2048))


def _mosaic_smem_bytes(case) -> int:
  """The SMEM Mosaic GPU allocates for the case's kernel: with a 0-byte limit every kernel fails
  to lower with `smem_bytes=...` in the message."""
  jax.clear_caches()  # a cached lowering would not reach the check
  with mosaic_core.artificial_shared_memory_limit(0):
    with pytest.raises(Exception, match="exceeds available shared memory") as info:
      ks.lower(case)
  return int(re.search(r"smem_bytes=(\d+)", str(info.value)).group(1))


def _sample_cases():
  """Two differently configured cases per op and architecture, FP8 and BF16."""
  picks = {}
  for case in ks.cases(models=("maverick",), tps=(1, 8), tokens=(1, 200, 4096)):
    if case.name not in ("q", "o", "experts.gate_up", "experts.down", "prefill", "decode T=1",
                         "tree T=8", "paged decode T=1", "paged tree T=8"):
      continue
    plan = ks.plan(case)
    paged = case.p.get("block") is not None  # the paged kernel also keeps a tile-id table
    picks.setdefault((case.op, case.arch, case.precision, plan.config, paged), case)
  by_op = {}
  for (op, arch, precision, _, paged), case in picks.items():
    by_op.setdefault((op, arch, precision, paged), []).append(case)
  return [c for cases in by_op.values() for c in cases[:2]]


@pytest.mark.parametrize("case", _sample_cases(), ids=lambda c: c.describe().replace(" ", "")[:60])
def test_smem_estimate_is_what_mosaic_allocates(case):
  plan = ks.plan(case)
  actual = _mosaic_smem_bytes(case)
  # Never below (the config would fail to lower) and at most one alignment unit above.
  assert actual <= plan.smem_bytes <= actual + resources.SMEM_ALIGNMENT, (
      f"{case.describe()}: planner {plan.smem_bytes} bytes, Mosaic {actual}")


def test_former_sm90_smem_failures_now_plan_and_lower():
  for n, k in FORMER_FAILURES_NK:
    for m in range(129, 1001):
      plan = gemm_plan.plan(m, n, k, FP8, FP8, arch="sm90")
      assert plan.supported and plan.smem_bytes <= resources.MAX_SMEM_BYTES["sm90"], (m, n, k)
  shape = jax.ShapeDtypeStruct
  for n, k in FORMER_FAILURES_NK:
    for m in (129, 1000):
      gemm_lower = lambda x, w, xs, ws: gemm.gemm(x, w, xs, ws, implementation="pallas")
      pallas_kernels.lower_for_gpu(
          gemm_lower, shape((m, k), FP8), shape((n, k), FP8), shape((m,), jnp.float32),
          shape((n,), jnp.float32), arch="sm90")


def test_without_the_smem_check_the_split_k_gemm_does_not_lower(monkeypatch):
  """The planner's SMEM limit is what keeps M=200 FP8 from the 280656-byte split-K config."""
  monkeypatch.setitem(resources.MAX_SMEM_BYTES, "sm90", 10**9)
  plan = gemm_plan.plan(200, 5120, 5120, FP8, FP8, arch="sm90")
  assert plan.config.k_splits > 1 and plan.smem_bytes == 280656
  case = ks.Case("gemm", "q", "maverick", 1, "fp8", 200, "sm90",
                 (("n", 5120), ("k", 5120), ("dtype", "float8_e4m3fn"), ("layout", "nk")))
  jax.clear_caches()
  with pytest.raises(Exception, match="exceeds available shared memory"):
    ks.lower(case)


def test_tmem_and_smem_limits_are_reported():
  usage = resources.Usage().smem("big", (1024, 1024), jnp.bfloat16).tmem(520)
  why = usage.over("sm100")
  assert "SMEM" in why and "TMEM" in why and "big" in why
  assert resources.Usage().tmem(512).over("sm100") == ""
  assert "TMEM" in resources.Usage().tmem(8).over("sm90")


def test_pallas_support_is_the_planners_answer():
  ok, why = gemm.pallas_support(FP8, FP8, 5120, 5120, m=200, arch="sm90")
  assert ok and not why
  ok, why = gemm.pallas_support(jnp.bfloat16, jnp.bfloat16, 25256, 5120, "kn", m=1, arch="sm90")
  assert not ok and "multiple of 16" in why
  # Too large a schedule for SMEM: the grouped GEMM says so instead of failing to build.
  from pallas_kernels import grouped_gemm
  x = jax.ShapeDtypeStruct((4_000_000, 5120), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((16, 5120, 8192), jnp.bfloat16)
  ok, why = grouped_gemm.pallas_support(x, w, w_layout="ekn", arch="sm90")
  assert not ok and "split the rows" in why
