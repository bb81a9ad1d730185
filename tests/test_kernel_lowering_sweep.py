"""Every kernel call of Maverick and Scout either lowers for sm_90 / sm_100 or is declared
unsupported by its op's resource planner (never a Mosaic GPU error at build time).

The sweep (maverick.kernel_sweep): q/k/v/o, dense gate/up/down (Maverick), shared expert
gate/up/down, router and lm_head GEMMs; the routed experts' grouped GEMMs (gate/up SwiGLU, down);
prefill attention (chunked and global) and decode/verify attention (T = 1..4 queries, tree; over a
contiguous and over a paged cache) at TP 1/4/8, BF16 and FP8, M in kernel_sweep.TOKENS, sm90 and
sm100: ~10k calls.

Why CI lowers one case per distinct planner config and not all ~1.9k distinct lowerings: what
Mosaic GPU checks when it lowers (SMEM and TMEM allocation, barriers, swizzles and layouts, wgmma /
tcgen05 operand shapes, register layouts of the epilogue) is fixed by the kernel's config and the
static facts of its body (dtypes, weight layout, scales, chunked or not, tree words), which
`kernel_sweep.config_key` collects; the problem shape only sets grid sizes, loop trip counts and
the GMEM side of TMA descriptors, whose alignment the planners check (N % 16, K in 32-byte
steps, S % 64, ...). `test_each_distinct_config_lowers` asserts that the configs it lowers are
exactly the set the planners emit over the whole sweep, so a planner change that emits a new config
is lowered here. The exhaustive version (every distinct padded shape) runs with
MAVERICK_FULL_KERNEL_SWEEP=1 (~25 min of one core; all 1881 lowerings passed).
"""

from __future__ import annotations

import functools
import os

import pytest

from maverick import kernel_sweep as ks
from pallas_kernels import KernelInputError

OPS = ("gemm", "grouped_gemm", "prefill_attention", "decode_attention")


@functools.lru_cache(maxsize=None)
def _planned(op: str, arch: str):
  """[(case, plan)] for the op's whole sweep on arch."""
  return [(c, ks.plan(c)) for c in ks.cases(archs=(arch,), ops=(op,))]


def _representatives(op: str, arch: str, key):
  reps = {}
  for case, plan in _planned(op, arch):
    if plan.supported:
      reps.setdefault(key(case, plan), case)
  return reps


def _lower_all(cases) -> list[str]:
  failures = []
  for case in cases:
    try:
      ks.lower(case)
    except Exception as e:  # noqa: BLE001 - every failure is reported, with its case
      failures.append(f"{case.describe()}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
  return failures


@pytest.mark.slow
@pytest.mark.parametrize("arch", ks.ARCHS)
@pytest.mark.parametrize("op", OPS)
def test_each_distinct_config_lowers(op, arch):
  reps = _representatives(op, arch, ks.config_key)
  emitted = {ks.config_key(c, p) for c, p in _planned(op, arch) if p.supported}
  assert emitted == {ks.config_key(c) for c in reps.values()}
  assert reps, f"the sweep has no supported {op} case on {arch}"
  failures = _lower_all(reps.values())
  assert not failures, (f"{len(failures)} of {len(reps)} planner-approved {op} configs fail to "
                        f"lower on {arch}:\n" + "\n".join(failures))


@pytest.mark.parametrize("arch", ks.ARCHS)
@pytest.mark.parametrize("op", OPS)
def test_unsupported_calls_say_why_and_fall_back(op, arch):
  """Every unsupported case has a reason, and the public op refuses it with KernelInputError under
  implementation="pallas" (the model's auto mode then runs XLA), not with a Mosaic error."""
  unsupported = [(c, p) for c, p in _planned(op, arch) if not p.supported]
  assert all(p.why for _, p in unsupported)
  seen = set()
  for case, plan in unsupported:
    if plan.why in seen:
      continue
    seen.add(plan.why)
    with pytest.raises(KernelInputError, match="does not support"):
      ks.lower(case)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MAVERICK_FULL_KERNEL_SWEEP"),
                    reason="exhaustive sweep: set MAVERICK_FULL_KERNEL_SWEEP=1 (~25 min)")
@pytest.mark.parametrize("arch", ks.ARCHS)
@pytest.mark.parametrize("op", OPS)
def test_every_distinct_lowering(op, arch):
  reps = _representatives(op, arch, ks.lowering_key)
  failures = _lower_all(reps.values())
  assert not failures, (f"{len(failures)} of {len(reps)} {op} lowerings fail on {arch}:\n"
                        + "\n".join(failures))


@pytest.mark.slow
def test_kernel_support_script():
  """scripts/kernel_support.py on one model/arch/TP and two token counts, lowering each config."""
  import pathlib
  import subprocess
  import sys

  from param_utils import single_device_env
  script = pathlib.Path(__file__).parent.parent / "scripts" / "kernel_support.py"
  p = subprocess.run(
      [sys.executable, str(script), "--models", "scout", "--archs", "sm90", "--tps", "8",
       "--tokens", "1,200", "--precisions", "fp8", "--lower"],
      env=single_device_env(), capture_output=True, text=True, timeout=600)
  assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
  assert "unsupported" in p.stdout and "lm_head" in p.stdout and "multiple of 16" in p.stdout
  assert "lowers" in p.stdout and "FAILS" not in p.stdout
