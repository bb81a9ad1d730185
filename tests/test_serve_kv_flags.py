"""scripts/serve.py's paged KV flags: a paged-only flag without --kv_layout=paged is a one-line
error, and a paged server's /health reports its pool (blocks used / free, block size, prefix hit
rate, preemptions) as the requests run."""

import pathlib
import subprocess
import sys
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from param_utils import single_device_env  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
SERVE = str(REPO / "scripts" / "serve.py")


@pytest.mark.parametrize("flag", ["--prefix_cache", "--num_blocks=8", "--nochunk_local",
                                  "--table_widths=2", "--num_chunked_blocks=4"])
def test_a_paged_flag_without_the_paged_layout_is_a_one_line_error(flag):
  r = subprocess.run([sys.executable, SERVE, flag, "--port=0"], cwd=REPO, env=single_device_env(),
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 1, r.stderr
  assert r.stderr.startswith("serve: error: ") and "--kv_layout=paged" in r.stderr, r.stderr
  assert flag.split("=")[0].replace("--no", "--") in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("widths,words", [("4,x", "--table_widths: 4,x are not all integers"),
                                          ("9", "table_widths must be block counts in [1, 3]")])
def test_bad_table_widths_are_a_one_line_error(widths, words):
  r = subprocess.run([sys.executable, SERVE, "--kv_layout=paged", f"--table_widths={widths}",
                      "--spec_k=0", "--max_seq_len=64", "--block_size=32", "--port=0"], cwd=REPO,
                     env=single_device_env(), capture_output=True, text=True, timeout=300)
  assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
  assert r.stderr.startswith("serve: error: ") and words in r.stderr, r.stderr


def test_health_shows_the_paged_pools(tmp_path):
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = single_device_env()
  env.setdefault("MAVERICK_CACHE_DIR", str(tmp_path / "cache"))
  log = tmp_path / "server.log"
  with open(log, "w") as out:
    proc = subprocess.Popen(
        [sys.executable, SERVE, f"--port={port}", "--spec_k=0", "--slots=2", "--max_seq_len=64",
         "--min_bucket=64", "--batch_buckets=2", "--rounds=2", "--kv_layout=paged",
         "--num_blocks=9", "--num_chunked_blocks=5", "--block_size=32", "--prefix_cache",
         "--table_widths=1", "--compaction"],
        cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
  base = f"http://127.0.0.1:{port}"
  try:
    deadline, health = time.monotonic() + 600, None
    while time.monotonic() < deadline and proc.poll() is None:
      try:
        r = httpx.get(f"{base}/health", timeout=5)
        if r.status_code == 200:
          health = r.json()
          break
      except httpx.TransportError:
        pass
      time.sleep(0.5)
    assert health is not None, f"not ready (exit {proc.poll()}):\n{log.read_text()[-3000:]}"
    assert health["kv_layout"] == "paged" and health["block_size"] == 32
    assert health["global_blocks_free"] == 9 and health["global_blocks_used"] == 0
    assert health["chunked_blocks_free"] == 5  # the embedded model's chunk (128) is 4 blocks
    assert health["preemptions"] == 0 and health["prefix_hit_rate"] == 0.0
    prompt = [(7 * i) % 4000 + 1 for i in range(40)]  # one full block of 32 to share
    for _ in range(2):
      body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
      assert httpx.post(f"{base}/v1/completions", json=body, timeout=120).status_code == 200
    health = httpx.get(f"{base}/health", timeout=5).json()
    assert health["prefix_hit_rate"] == pytest.approx(32 / 80)  # the second hit one block of 40
    assert health["global_blocks_free"] == 9  # cached blocks are evictable: they count as free
  finally:
    proc.terminate()
    try:
      proc.wait(30)
    except subprocess.TimeoutExpired:
      proc.kill()
