"""benchmarks/serving.py: the tree it picks, its flag errors, and one small end-to-end run against
real servers (numbers are not checked, only that every level was measured and written)."""

import json
import pathlib
import socket
import subprocess
import sys

import pytest

from param_utils import single_device_env

REPO = pathlib.Path(__file__).resolve().parents[1]


def _best_tree(results: dict) -> subprocess.CompletedProcess:
  """benchmarks/serving.py's best_tree, in its own process: importing it here would define its
  absl flags next to scripts/benchmark.py's (test_benchmark.py) in the same pytest worker."""
  code = ("import json, sys; sys.path.insert(0, 'benchmarks'); import serving; "
          "print(serving.best_tree(json.loads(sys.argv[1])))")
  return subprocess.run([sys.executable, "-c", code, json.dumps(results)], cwd=REPO,
                        capture_output=True, text=True, timeout=120)


def _row(batch, tree, tps):
  return {"batch": batch, "k": None if tree else 3, "tree": tree, "tokens_per_second_per_user": tps}


def test_best_tree_is_the_fastest_branching_tree_at_batch_1():
  results = {"rows": [
      _row(1, None, 350.0),        # the K=3 chain: not a tree
      _row(1, "3x1x3", 345.8),     # top-k 1: a chain written as a tree
      _row(1, "4x2x8", 274.2),
      _row(1, "5x8x32", 216.2),
      _row(4, "5x8x32", 300.0),    # batch 4 does not count
  ]}
  r = _best_tree(results)
  assert r.returncode == 0 and r.stdout.strip() == "4x2x8", r.stderr
  r = _best_tree({"rows": [_row(1, "3x1x3", 1.0), _row(1, None, 2.0)]})
  assert r.returncode != 0 and "pass --tree" in r.stderr


@pytest.mark.parametrize("flag,words", [
    ("--tree=4x2", "is not DEPTHxTOPKxNODES"),
    ("--concurrency=1,two", "are not all integers"),
    ("--modes=off,beam", "'beam' is not one of"),
], ids=["tree", "concurrency", "modes"])
def test_bad_flags_are_one_line_errors(flag, words):
  r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serving.py"), flag], cwd=REPO,
                     env=single_device_env(), capture_output=True, text=True, timeout=120)
  assert r.returncode == 1, r.stderr
  assert r.stderr.startswith("serving: error: ") and words in r.stderr, r.stderr


@pytest.mark.slow
def test_small_run_measures_every_level(tmp_path):
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  r = subprocess.run(
      [sys.executable, str(REPO / "benchmarks" / "serving.py"), "--concurrency=1,2",
       "--modes=off,tree", "--tree=2x2x3", "--prompt_len=8", "--max_tokens=6",
       "--requests_per_user=1", "--min_requests=1", "--rounds=2", f"--port={port}", f"--out_dir={tmp_path}"],
      cwd=REPO, env=single_device_env(), capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  rows = json.loads((tmp_path / "serving_cpu.json").read_text())
  assert [(x["mode"], x["users"]) for x in rows] == [("off", 1), ("off", 2), ("tree", 1),
                                                      ("tree", 2)]
  for x in rows:
    assert x["requests"] == x["users"] and x["tokens"] == 6 * x["users"]  # ignore_eos: all 6
    assert x["tps_user"] > 0 and x["tps_server"] > 0 and x["ttft_s"] > 0
    assert (x["acceptance"] is None) == (x["mode"] == "off")
    assert x["tree"] == ("2x2x3" if x["mode"] == "tree" else None)
  assert x["acceptance"] >= 1.0
  assert "tree 2x2x3" in (tmp_path / "serving_cpu.md").read_text()
  assert (tmp_path / "serving_cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
