"""benchmarks/kernels.py --interpret: toy shapes of every kernel in GPU interpret mode, checked
against the XLA reference, written to JSON (the GPU run uses the same code at Maverick shapes)."""

import functools
import importlib.util
import json
from pathlib import Path

import pytest
from absl import app

ROOT = Path(__file__).resolve().parents[1]


@functools.cache  # once per process: the script defines absl flags at import
def _load():
  spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "benchmarks" / "kernels.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.slow
def test_interpret_run_writes_checked_results(tmp_path):
  bench = _load()
  out = tmp_path / "cpu-kernels.json"
  payload = bench.run(list(bench.OPS), interpret=True, iters=1, out=str(out))
  saved = json.loads(out.read_text())
  assert saved == json.loads(json.dumps(payload))
  assert saved["interpret"] and "not a GPU speed" in saved["timing"]
  assert saved["ceilings"]["hbm_GBps"] > 0 and saved["ceilings"]["bf16_matmul_TFLOPs"] > 0
  ops = {r["op"] for r in saved["results"]}
  assert ops == set(bench.OPS)
  for r in saved["results"]:
    assert r["correct"], r
    assert r["time_us"] > 0 and r["flops"] > 0 and r["bytes"] > 0
    assert set(r["baselines_us"]) == set(r["speedup"]) | {
        k for k, v in r["baselines_us"].items() if isinstance(v, str)}


def test_refuses_without_gpu_or_interpret(tmp_path):
  bench = _load()
  with pytest.raises(app.UsageError, match="--interpret"):
    bench.run(["gemm"], interpret=False, iters=1, out=str(tmp_path / "x.json"))
  with pytest.raises(app.UsageError, match="unknown"):
    bench.run(["conv"], interpret=True, iters=1, out=str(tmp_path / "x.json"))


def test_goal_parsing():
  bench = _load()
  r = {"hbm_fraction": 0.85, "speedup": {"ragged_dot": 0.9}}
  assert bench.goal_met(">= 80% of HBM bandwidth", r) is True
  assert bench.goal_met(">= 1.0x ragged_dot", r) is False
  assert bench.goal_met(">= 1.0x cudnn", r) is None and bench.goal_met("", r) is None
