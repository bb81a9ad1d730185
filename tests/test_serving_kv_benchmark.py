"""benchmarks/serving_kv.py: its request mix, one tiny run of both parts in process (structure
only, no speed asserted) and its flag errors."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from param_utils import single_device_env

REPO = pathlib.Path(__file__).resolve().parents[1]
PATH = REPO / "benchmarks" / "serving_kv.py"


@pytest.fixture(scope="module")
def bench():
  spec = importlib.util.spec_from_file_location("serving_kv", PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)  # defines no flags: those come with define_flags (a script)
  return module


def test_the_mix_is_lognormal_clipped_and_seeded(bench):
  mix = bench.mix(20000, 2047, 3, 100, 64, 1.0)
  p, o = np.array(mix).T
  assert p.min() >= 16 and p.max() <= 1023 and o.min() >= 4 and o.max() <= 1023
  assert np.all(p + o <= 2047)
  # Medians of lognormal(ln m, 1): m (the clipping touches only the tails).
  assert abs(np.median(p) - 100) < 4 and abs(np.median(o) - 64) < 3
  assert np.mean(p > 300) == pytest.approx(0.136, abs=0.01)  # P(Z > ln 3): the long tail
  assert bench.mix(20000, 2047, 3, 100, 64, 1.0) == mix  # fixed seed
  assert bench.mix(20000, 2047, 4, 100, 64, 1.0) != mix


def test_a_tiny_run_measures_every_layout_and_both_prefix_modes(bench, tmp_path):
  s = bench.Setup(capacity=128, block_size=32, paged_slots=4, requests=6, rounds=2,
                  min_bucket=128, system_len=64, ttft_requests=2, out_dir=str(tmp_path),
                  batch_buckets=lambda slots: [slots])
  res = bench.run(s)
  rows = res["capacity"]
  assert [r["layout"] for r in rows] == ["contiguous", "paged", "paged + chunk-local"]
  lengths = bench.mix(6, 127, 0, 100, 64, 1.0)
  for r in rows:
    assert r["budget_blocks"] == 8 * 128 // 32 and r["max_seq_len"] == 127
    assert r["tokens"] == sum(o for _, o in lengths) and r["tps_server"] > 0
    assert 1 <= r["max_concurrent"] <= r["slots"]
  assert rows[0]["slots"] == 8 and rows[0]["peak_blocks_used"] == {}
  assert set(rows[1]["peak_blocks_used"]) == {"global_blocks_used"}
  assert set(rows[2]["peak_blocks_used"]) == {"global_blocks_used", "chunked_blocks_used"}
  off, on = res["prefix"]
  assert (off["prefix_cache"], on["prefix_cache"]) == (False, True)
  assert off["prefix_hit_rate"] == 0 and on["prefix_hit_rate"] > 0
  assert len(on["ttft_s"]) == 2 and all(t > 0 for t in on["ttft_s"] + off["ttft_s"])
  assert set(res["summary"]) == {"k0 paged concurrency x", "k0 paged tokens/s x",
                                 "k0 paged + chunk-local concurrency x",
                                 "k0 paged + chunk-local tokens/s x", "ttft off/on x"}
  stem = tmp_path / f"serving_kv_{res['device']}"
  assert json.loads(stem.with_suffix(".json").read_text())["summary"] == res["summary"]
  assert "| 0 | paged + chunk-local | 4 |" in stem.with_suffix(".md").read_text()
  assert stem.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_speculative_run_on_rows_past_the_models_context(bench, tmp_path):
  """--spec_k 3 with rows longer than the embedded model's 512 positions: the draft's context is
  extended with the target's (it used to fail on the draft's config), every layout serves it."""
  s = bench.Setup(parts=("capacity",), spec_k=(3,), capacity=576, block_size=64, paged_slots=2,
                  requests=3, rounds=2, min_bucket=128, out_dir=str(tmp_path),
                  batch_buckets=lambda slots: [slots], table_widths=())
  res = bench.run(s)
  rows = res["capacity"]
  assert [(r["spec_k"], r["layout"]) for r in rows] == [
      (3, "contiguous"), (3, "paged"), (3, "paged + chunk-local")]
  lengths = bench.mix(3, 575, 0, 100, 64, 1.0)
  assert all(r["tokens"] == sum(o for _, o in lengths) for r in rows)
  assert set(res["summary"]) == {"k3 paged concurrency x", "k3 paged tokens/s x",
                                 "k3 paged + chunk-local concurrency x",
                                 "k3 paged + chunk-local tokens/s x"}


@pytest.mark.parametrize("flag,words", [
    ("--parts=capacity,speed", "'speed' is not one of"),
    ("--spec_k=0,three", "are not all integers"),
    ("--capacity=1000", "must be a multiple of --block_size"),
], ids=["parts", "spec_k", "capacity"])
def test_bad_flags_are_one_line_errors(flag, words):
  r = subprocess.run([sys.executable, str(PATH), flag], cwd=REPO, env=single_device_env(),
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 1, r.stderr
  assert r.stderr.startswith("serving_kv: error: ") and words in r.stderr, r.stderr
