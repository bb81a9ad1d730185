"""benchmarks/gpu_check.py --interpret --toy: the whole GPU check on CPU (toy kernel shapes in GPU
interpret mode, a 4-layer FP8 model for the end-to-end part, the flags-off child process), writing
both result files. Proves the script; its timings mean nothing."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load():
  spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


RUNS_IN_A_ROW = 5  # the bar: a hang in the interpreter was once seen in one run of three


def _toy_run(out_dir: Path, run: int):
  # In a subprocess with a time limit: a hang in the interpreter must fail this test, not take
  # down the pytest worker.
  import subprocess
  import sys
  cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--interpret", "--toy",
         "--e2e_modes", "plain", "--out_dir", str(out_dir)]
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
  except subprocess.TimeoutExpired as e:
    pytest.fail(f"run {run}: gpu_check --interpret --toy ran past 300 s (one run takes about "
                f"60 s); its output:\n{e.stdout}\n{e.stderr}")
  assert proc.returncode == 0, f"run {run}: " + proc.stdout[-2000:] + proc.stderr[-3000:]
  return (json.loads((out_dir / "cpu-interpret-toy-gpu_check.json").read_text()),
          (out_dir / "cpu-interpret-toy-gpu_check.md").read_text())


@pytest.mark.slow
def test_toy_run_writes_results_five_runs_in_a_row(tmp_path):
  gpu_check = _load()
  for run in range(1, RUNS_IN_A_ROW + 1):
    saved, md = _toy_run(tmp_path / f"run{run}", run)
    assert saved["interpret"] and "not a GPU speed" in saved["timing"]
    assert {r["op"] for r in saved["kernels"]} == {"gemm", "grouped_gemm", "prefill_attention",
                                                   "decode_attention"}
    assert all(r["correct"] is True for r in saved["kernels"]), (run, saved["kernels"])
    for r in saved["timings"]:
      assert r["status"] == "ok" and r["time_us"] > 0, (run, r)
    e2e = {r["loop_flags"]: r for r in saved["e2e"]}
    assert set(e2e) == {"off", "n/a (no CUDA backend)"}, saved["e2e"]  # the child ran, flags off
    for r in e2e.values():
      assert r["status"] == "ok" and r["mode"] == "plain" and r["loop_iterations"] == 63, (run, r)
      assert r["tokens_per_s"] > 0
    assert [g["goal"] for g in saved["goals"]] == [k for k, _ in gpu_check.GOALS]
    assert all(g["met"] is None and g["measured"].startswith("not measured")
               for g in saved["goals"])
    assert "not measured" in md and "## End to end" in md


def test_goals_from_measurements():
  gpu_check = _load()
  payload = {"interpret": False, "timings": [
      {"status": "ok", "goal": "decode_fp8_gemm", "case": "a", "hbm_peak_fraction": 0.85,
       "speedup": {}},
      {"status": "ok", "goal": "decode_fp8_gemm", "case": "b", "hbm_peak_fraction": 0.75,
       "speedup": {}},
      {"status": "ok", "goal": "grouped_gemm", "case": "c", "speedup": {gpu_check.GROUPED_BASELINE: 1.2}},
  ], "e2e": [
      {"status": "ok", "mode": "plain", "kernels": "pallas", "loop_flags": "on", "batch": 1,
       "per_step_ms": 0.7, "d2h_copies_per_call": 0},
      {"status": "ok", "mode": "plain", "kernels": "pallas", "loop_flags": "off", "batch": 1,
       "per_step_ms": 0.9, "d2h_copies_per_call": 63},
  ]}
  goals = {g["goal"]: g for g in gpu_check.evaluate_goals(payload)}
  assert goals["decode_fp8_gemm"]["met"] is False and "75.0%" in goals["decode_fp8_gemm"]["measured"]
  assert goals["grouped_gemm"]["met"] is True
  assert goals["prefill_fp8_gemm"]["measured"] == "not measured"
  assert goals["decode_attention"]["met"] is None
  assert goals["shard_decode_step"]["met"] is True  # the flags-on row
  assert goals["zero_d2h"]["met"] is True and goals["zero_d2h"]["measured"] == "plain/pallas: 0"


def test_peaks_and_names():
  gpu_check = _load()
  assert gpu_check.peaks_for("NVIDIA H200")["hbm_TBps"] == 4.8
  assert gpu_check.peaks_for("NVIDIA B200")["fp8_TFLOPs"] == 4500.0
  assert gpu_check.peaks_for("NVIDIA A100-SXM4-80GB") is None
  assert gpu_check.sanitize("NVIDIA H200 NVL") == "nvidia-h200-nvl"


@pytest.mark.slow
def test_shard_cases_lower_for_sm90():
  """Every kernel case of the GPU run, at the TP8-rank shard shapes, goes through Mosaic GPU layout
  inference and lowering on this host (only shapes: nothing is allocated). The one case the kernel
  does not take (lm_head, N = 202048 / 8 = 25256 is not a multiple of 16) is refused up front, as
  the GPU run records it."""
  import jax

  from pallas_kernels import common
  gpu_check = _load()
  cases = gpu_check.build_cases(False, "sm90")
  assert {c.op for c in cases} == {"gemm", "grouped_gemm", "prefill_attention", "decode_attention"}
  refused = []
  for case in cases:
    abstract = jax.eval_shape(case.make)
    try:
      text = common.lower_for_gpu(case.kernel, *abstract, arch="sm90")
    except common.KernelInputError:
      refused.append(case.name)
      continue
    assert "mosaic_gpu" in text, case.name
  assert refused == ["maverick/scout decode lm_head bfloat16 M=16 N=25256 K=5120"]


def test_static_fp8_cases():
  """Both FP8 activation modes are checked and timed: the static cases (ModelOpt: scalar x and w
  scales, broadcast inside the timed program) of the decode / prefill GEMM and the decode grouped
  GEMM follow their per-token twins, and the toy ones pass in interpret mode."""
  gpu_check = _load()
  names = [c.name for c in gpu_check.build_cases(False, None)]
  for case in ("maverick decode mlp gate/up float8_e4m3fn static M=16",
               "maverick prefill prefill mlp gate/up float8_e4m3fn static M=8192",
               "maverick decode float8_e4m3fn static swiglu(gate, up) A=16"):
    twin = case.replace(" static", "")
    assert any(n.startswith(case) for n in names) and any(n.startswith(twin) for n in names)
  firsts = {}
  for c in gpu_check.build_cases(False, None):
    firsts.setdefault(c.op, c.name)
  assert "static" not in firsts["gemm"] and "static" not in firsts["grouped_gemm"], firsts
  static = [c for c in gpu_check.build_cases(True, None) if " static " in c.name]
  assert sorted(c.op for c in static) == ["gemm", "grouped_gemm"]
  for case in static:
    scales = [a for a in case.make() if a is not None and a.dtype.name == "float32"]
    assert scales and all(a.shape == () for a in scales), case.name
    row = gpu_check.check_case(case, interpret=True)
    assert row["correct"] is True, row


def test_input_copies_exceed_twice_the_l2():
  import jax.numpy as jnp
  gpu_check = _load()
  args = (jnp.ones((4,)), None, jnp.zeros((2,), jnp.int32))
  copies = gpu_check._copies(args, case_bytes=10e6, l2_bytes=50e6)
  assert len(copies) == 11 and len(copies) * 10e6 > 2 * 50e6  # ceil(100 / 10) + 1
  assert copies[1][1] is None and copies[1][0] is not copies[0][0]
  assert len(gpu_check._copies(args, case_bytes=1e3, l2_bytes=50e6)) == 32  # capped
  assert len(gpu_check._copies(args, case_bytes=5e9, l2_bytes=50e6)) == 2  # at least 2
