"""scripts/benchmark.py: a tiny sweep end to end (files and their fields), and its input checks."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from maverick.cli import UsageError
from maverick.commands import benchmark  # scripts/benchmark.py runs this module
from param_utils import single_device_env

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "benchmark.py"


def _run(*args, timeout=300):
  env = dict(single_device_env(), JAX_PLATFORMS="cpu")  # one device, as a user runs it
  return subprocess.run([sys.executable, str(SCRIPT), "--noprogress", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_tiny_sweep_writes_json_table_plots_and_profile(tmp_path):
  out, prof = tmp_path / "out", tmp_path / "prof"
  r = _run("--ks=2", "--batch_sizes=1,2", "--prompt_lens=16", "--output_lens=16",
           "--num_prompts=2", "--repeats=1", f"--out_dir={out}", f"--profile_dir={prof}")
  assert r.returncode == 0, r.stderr
  names = sorted(os.listdir(out))
  assert names == ["benchmark_cpu.json", "benchmark_cpu.md", "benchmark_cpu_batch.png",
                   "benchmark_cpu_speedup.png"]
  for png in names[2:]:
    assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  res = json.loads((out / "benchmark_cpu.json").read_text())
  assert res["checkpoint"] == "tiny" and res["draft"] == "tiny" and res["device"] == "cpu"
  assert res["settings"]["ks"] == [0, 2]  # K = 0 added as the baseline
  rows = res["rows"]
  assert [(r["batch"], r["draft"]) for r in rows] == [(1, "K=0"), (1, "K=2"), (2, "K=0"),
                                                       (2, "K=2")]
  for r in rows:
    assert r["tokens"] == 2 * 16  # stop tokens off: each of the 2 prompts generates 16 tokens
    assert r["tokens_per_second"] > 0 and r["ttft_seconds"] > 0 and r["compile_seconds"] > 0
    assert r["tokens_per_second_per_user"] == pytest.approx(r["tokens_per_second"] / r["batch"])
    base = next(b for b in rows if b["batch"] == r["batch"] and b["draft"] == "K=0")
    assert r["speedup_vs_k0"] == pytest.approx(r["tokens_per_second"] / base["tokens_per_second"])
    if r["draft"] == "K=2":
      # tokens per verify step: 1..K+1; per-position rates are non-increasing in [0, 1]
      assert 1.0 <= r["acceptance_length"] <= 3.0
      a, b = r["per_position_acceptance"]
      assert 1.0 >= a >= b >= 0.0
      assert r["acceptance_length"] == pytest.approx(1.0 + a + b)
    else:
      assert "acceptance_length" not in r
  table = (out / "benchmark_cpu.md").read_text()
  assert table.count("\n| ") == 1 + len(rows)  # header + one line per row
  assert "| 2 | 16 | 16 | K=2 |" in table and "python scripts/benchmark.py" in table
  assert list(prof.glob("plugins/profile/*/*.xplane.pb")), "no profiler trace written"


@pytest.mark.slow
def test_tree_shapes_are_swept(tmp_path):
  r = _run("--ks=0", "--trees=3x2x4", "--batch_sizes=1", "--prompt_lens=16", "--output_lens=16",
           "--num_prompts=1", "--repeats=1", f"--out_dir={tmp_path}")
  assert r.returncode == 0, r.stderr
  rows = json.loads((tmp_path / "benchmark_cpu.json").read_text())["rows"]
  tree = next(x for x in rows if x["draft"] == "tree 3x2x4")
  assert tree["draft_shape"] == {"kind": "tree", "depth": 3, "topk": 2, "nodes": 4}
  assert len(tree["per_position_acceptance"]) == 3  # one rate per tree level
  assert 1.0 <= tree["acceptance_length"] <= 4.0


@pytest.mark.slow
@pytest.mark.parametrize("args,words", [
    (["--batch_sizes=0"], "--batch_sizes: 0 must be >= 1"),
    (["--batch_sizes=4", "--num_prompts=2", "--ks=0"], "raise --num_prompts"),
    (["--ks=a"], "--ks: 'a' is not an integer"),
    (["--trees=5x8"], "is not DEPTHxTOPKxNODES"),
    (["--trees=3x2x2"], "nodes >= depth"),
    (["--checkpoint=random:tiny", "--ks=0,1"], "pass --draft, or --ks 0"),
])
def test_bad_input_is_one_clear_line(args, words, tmp_path):
  r = _run(*args, "--output_lens=16", "--prompt_lens=16", f"--out_dir={tmp_path}")
  assert r.returncode == 1
  assert words in r.stderr and "Traceback" not in r.stderr, r.stderr
  assert not os.listdir(tmp_path)  # nothing half-written


def test_shapes_parse():
  shapes = benchmark.draft_shapes(["3", "1", "3"], ["5x8x32"])
  assert [s.label for s in shapes] == ["K=0", "K=1", "K=3", "tree 5x8x32"]
  assert shapes[-1].to_json() == {"kind": "tree", "depth": 5, "topk": 8, "nodes": 32}
  with pytest.raises(UsageError, match="nodes >= depth"):
    benchmark.parse_tree("4x4x3")
