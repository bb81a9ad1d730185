"""benchmarks/greedy_consistency.py: its pure helpers against NumPy and hand-worked cases (fast),
and one small run of the script end to end (slow)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import greedy_consistency as gc  # noqa: E402
from param_utils import single_device_env  # noqa: E402


@pytest.mark.parametrize("a,b,want", [
    ([1, 2, 3], [1, 2, 3], None), ([], [], None), ([5, 2, 3], [1, 2, 3], 0),
    ([1, 2, 3], [1, 2, 4], 2), ([1, 2], [1, 2, 3], 2), ([1, 2, 3], [1], 1), ([], [7], 0)])
def test_first_divergence(a, b, want):
  assert gc.first_divergence(a, b) == want
  assert gc.first_divergence(b, a) == want


def test_top2_matches_numpy_with_ties_and_one_ulp_gaps():
  """jax.lax.top_k on f32 vs a stable NumPy sort: exact ties go to the lower id, a one-ulp gap is
  kept (not rounded away), the values are the f32 logits themselves."""
  rng = np.random.default_rng(3)
  logits = rng.normal(0, 4, (3, 5, 257)).astype(np.float32)
  top = logits.max(-1)
  logits[0, 0, 10] = logits[0, 0, 200] = top[0, 0] + 1  # exact tie: 10 first
  logits[1, 2, 7] = top[1, 2] + 2
  logits[1, 2, 3] = np.nextafter(logits[1, 2, 7], np.float32(np.inf))  # one ulp above
  logits[2, 4, 100] = logits[2, 4, 50] = top[2, 4] + 3  # tie in the order after the top
  ids, vals = gc.top2(logits)
  want_ids = np.argsort(-logits.astype(np.float64), axis=-1, kind="stable")[..., :2]
  np.testing.assert_array_equal(ids, want_ids)
  np.testing.assert_array_equal(vals, np.take_along_axis(logits, want_ids, -1))
  assert ids[0, 0].tolist() == [10, 200] and vals[0, 0, 0] == vals[0, 0, 1]
  assert ids[1, 2].tolist() == [3, 7] and vals[1, 2, 0] - vals[1, 2, 1] == np.spacing(vals[1, 2, 1])
  assert ids[2, 4].tolist() == [50, 100]


def test_step_error():
  """The forward says 4 over 9 by 0.5: a program with 4 over 9 by 0.3 moved it 0.2; one that flips
  to 9 over 4 by 0.1 moved it 0.6 (the whole way); one whose second token is 2 (another pair)
  compares top-1 - top-2 gaps."""
  assert gc.step_error([(4, -0.1), (9, -0.4)], [4, 9], 0.5) == pytest.approx(0.2)
  assert gc.step_error([(9, -0.1), (4, -0.2)], [4, 9], 0.5) == pytest.approx(0.6)
  assert gc.step_error([(4, -0.1), (2, -1.1)], [4, 9], 0.5) == pytest.approx(0.5)
  assert gc.step_error([(4, -1.0), (9, -1.5)], np.array([4, 9]), 0.5) == 0.0


def test_errors_stop_after_the_first_divergence():
  """Row 0 equals the reference (3 steps counted); row 1 diverges at step 1 (steps 0 and 1 counted:
  step 1 still saw the reference's prefix, step 2 did not)."""
  reference = [[4, 4, 4], [5, 6, 7]]
  forward = [[([4, 9], 1.0)] * 3, [([5, 1], 1.0), ([6, 2], 0.25), ([7, 3], 1.0)]]
  tokens = [[4, 4, 4], [5, 2, 8]]
  logprobs = [[(0.0, [(4, -0.5), (9, -1.0)])] * 3,
              [(0.0, [(5, 0.0), (1, -2.0)]), (0.0, [(2, 0.0), (6, -0.25)]),
               (0.0, [(8, 0.0), (7, -9.0)])]]
  got, where = gc.errors(forward, [(tokens, logprobs)], reference)
  np.testing.assert_allclose(got, [0.5, 0.5, 0.5, 1.0, 0.5])
  assert where == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1)]


def test_prompt_set_is_fixed():
  assert len(gc.PROMPTS) == 64 and gc.PROMPTS[0] == "The capital of France is"


@pytest.mark.slow
def test_a_small_run_writes_json_and_markdown(tmp_path):
  """3 prompts x 6 tokens in f32: every pair is compared on every row; each difference (if any)
  has a gap and a near-tie verdict against the measured bound."""
  r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "greedy_consistency.py"),
                      "--num_prompts=3", "--max_new_tokens=6", "--dtypes=float32",
                      f"--out_dir={tmp_path}"], cwd=REPO, env=single_device_env(),
                     capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads((tmp_path / "greedy_consistency.json").read_text())
  (run,) = res["results"]
  assert run["dtype"] == "float32" and run["error_samples"] >= 2 * 3 * 6 - 6
  assert 0 <= run["errors_median"] <= run["bound"] and run["reference_steps"] == 18
  names = [tuple(p["runs"]) for p in run["pairs"]]
  assert ("k3", "plain_bN") in names and ("engine_32", "engine_1") in names
  for p in run["pairs"]:
    assert p["rows"] == 3 and p["differ"] == len(p["differences"])
    for d in p["differences"]:
      assert d["near_tie"] == (d["gap"] <= run["bound"]) and 0 <= d["step"] < 6
      assert d["within_p99"] == (d["gap"] <= run["errors_p99"])
  md = (tmp_path / "greedy_consistency.md").read_text()
  assert "float32" in md and "| k3 vs plain_bN |" in md
  assert os.path.getsize(tmp_path / "greedy_consistency.json") > 0
