"""Serving benchmark: scripts/serve.py with the embedded pair under 1, 2, 4, ..., 64 concurrent users.

  python benchmarks/serving.py                                   # spec off, K=3, best tree
  python benchmarks/serving.py --concurrency 1,4,16 --modes off,k3 --max_tokens 64

For each mode a server is started (--slots = the largest concurrency), compiled and warmed up
(every level once, one request per user; not timed), then each concurrency level runs
--requests_per_user streaming requests per user back to back (greedy,
prompts = held-out stdlib files cut to --prompt_len tokens). Reported per level: tokens/s per user
(a request's tokens / its latency, averaged), tokens/s per server (all tokens / wall time), median
time to first token, and the acceptance length (tokens per verify round, from /health). Results:
benchmarks/results/serving_<device>.{json,md,png}.
"""

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from maverick import cli  # noqa: E402  (after the sys.path line)

MODES = ("off", "k3", "tree")
_MODES = flags.DEFINE_list("modes", list(MODES), f"Of {list(MODES)}: no speculation, a K=3 chain, "
                           "the --tree tree.")
_TREE = flags.DEFINE_string(
    "tree", "best", "Tree of the 'tree' mode, DEPTHxTOPKxNODES, or 'best': the branching tree "
    "(top-k > 1; top-k 1 is a chain) with the most tokens/s at batch 1 in "
    "benchmarks/results/spec_decode_<device>.json (python benchmarks/spec_decode.py).")
_CONC = flags.DEFINE_list("concurrency", ["1", "2", "4", "8", "16", "32", "64"], "Users.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Prompt tokens.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "Generated tokens per request.")
_PER_USER = flags.DEFINE_integer("requests_per_user", 4, "Requests each user sends in turn (at "
                                 "least; see --min_requests).")
_MIN_REQUESTS = flags.DEFINE_integer("min_requests", 32, "Requests per level at least: at low "
                                     "concurrency each user sends more, so every level runs long "
                                     "enough to time.")
_ROUNDS = flags.DEFINE_integer("rounds", 4, "--rounds of the server.")
_PORT = flags.DEFINE_integer("port", 8123, "Port of the servers started.")
_OUT_DIR = flags.DEFINE_string("out_dir", os.path.join(REPO, "benchmarks", "results"),
                               "Where the JSON, Markdown and PNG results go.")


def _prompts(n, length):
  import maverick
  from maverick import data
  tok = maverick.load("tiny").tokenizer
  val = data.load_split(None, "validation")
  docs = data.encode_documents(tok.hf_tokenizer, val.texts, tok.bos_id)
  prompts = [d[:length].tolist() for d in docs if len(d) > length]
  return [prompts[i % len(prompts)] for i in range(n)]


async def _user(client, base, prompts, out):
  for prompt in prompts:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": _MAX_TOKENS.value, "temperature": 0,
            "stream": True, "return_token_ids": True, "ignore_eos": True}
    start, first, n = time.perf_counter(), None, 0
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
      r.raise_for_status()
      async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
          continue
        k = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
        if k and first is None:
          first = time.perf_counter()
        n += k
    end = time.perf_counter()
    out.append(dict(tokens=n, latency=end - start, ttft=(first or end) - start))


async def _level(base, users, prompts, per):
  import httpx
  async with httpx.AsyncClient(timeout=600) as client:
    before = (await client.get(f"{base}/health")).json()
    out, start = [], time.perf_counter()
    await asyncio.gather(*(_user(client, base, prompts[u * per:(u + 1) * per], out)
                           for u in range(users)))
    wall = time.perf_counter() - start
    after = (await client.get(f"{base}/health")).json()
  rounds = after["spec_rounds"] - before["spec_rounds"]
  accepted = after["spec_accepted"] - before["spec_accepted"]
  tokens = sum(o["tokens"] for o in out)
  return dict(users=users, requests=len(out), tokens=tokens, wall_s=wall,
              tps_user=statistics.mean(o["tokens"] / o["latency"] for o in out),
              tps_server=tokens / wall, ttft_s=statistics.median(o["ttft"] for o in out),
              acceptance=accepted / rounds if rounds else None)


def best_tree(spec_results: dict) -> str:
  """The branching tree (top-k > 1) with the most tokens/s per user at batch 1."""
  trees = [r for r in spec_results["rows"]
           if r.get("tree") and r["batch"] == 1 and int(r["tree"].split("x")[1]) > 1]
  if not trees:
    raise cli.UsageError("the spec_decode results hold no branching tree at batch 1; pass --tree")
  return max(trees, key=lambda r: r["tokens_per_second_per_user"])["tree"]


def _tree(device: str) -> str:
  if _TREE.value != "best":
    parts = _TREE.value.split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
      raise cli.UsageError(f"--tree: {_TREE.value!r} is not DEPTHxTOPKxNODES (e.g. 4x2x8) or "
                           "'best'")
    return _TREE.value
  path = os.path.join(REPO, "benchmarks", "results", f"spec_decode_{device}.json")
  try:
    with open(path) as f:
      return best_tree(json.load(f))
  except FileNotFoundError:
    raise cli.UsageError(f"--tree=best reads {path}, which is missing: run "
                         "python benchmarks/spec_decode.py first, or pass --tree DxKxN") from None


def _mode_flags(mode: str, tree: str) -> list[str]:
  if mode == "off":
    return ["--spec_k=0"]
  if mode == "k3":
    return ["--spec_k=3"]
  depth, topk, nodes = tree.split("x")
  return [f"--tree_depth={depth}", f"--tree_topk={topk}", f"--tree_nodes={nodes}"]


def _serve(mode, slots, tree):
  import httpx
  args = [sys.executable, os.path.join(REPO, "scripts", "serve.py"), f"--port={_PORT.value}",
          f"--slots={slots}", f"--rounds={_ROUNDS.value}",
          f"--max_seq_len={_PROMPT_LEN.value + _MAX_TOKENS.value}", *_mode_flags(mode, tree)]
  proc = subprocess.Popen(args, cwd=REPO)
  base = f"http://127.0.0.1:{_PORT.value}"
  for _ in range(3600):
    if proc.poll() is not None:
      raise RuntimeError(f"serve.py {mode} exited with {proc.returncode}")
    try:
      if httpx.get(f"{base}/health", timeout=5).status_code == 200:
        return proc, base
    except httpx.TransportError:
      pass
    time.sleep(1)
  proc.kill()
  raise RuntimeError("server not ready after an hour")


def _host() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
  except (OSError, StopIteration):
    model = "unknown CPU"
  return f"{model}, {os.cpu_count()} cores"


def _report(rows, device, tree):
  lines = [f"# Serving benchmark ({device}; host {_host()})", "",
           f"Embedded target + draft, greedy, prompt {_PROMPT_LEN.value} tokens, "
           f"{_MAX_TOKENS.value} new tokens, max({_PER_USER.value}, {_MIN_REQUESTS.value} / users) "
           "requests per user, "
           f"--rounds {_ROUNDS.value}" + (f", tree {tree}" if tree else "") +
           ". `python benchmarks/serving.py`", "",
           "| mode | users | tokens/s per user | tokens/s per server | TTFT median (s) | "
           "acceptance length |", "|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    acc = f"{r['acceptance']:.2f}" if r["acceptance"] else "-"
    lines.append(f"| {r['mode']} | {r['users']} | {r['tps_user']:.1f} | {r['tps_server']:.1f} | "
                 f"{r['ttft_s']:.3f} | {acc} |")
  return "\n".join(lines) + "\n"


def _plot(rows, path, tree):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4.5))
  for mode in dict.fromkeys(r["mode"] for r in rows):
    rs = [r for r in rows if r["mode"] == mode]
    label = f"tree {tree}" if mode == "tree" else {"off": "off", "k3": "K=3"}[mode]
    ax.plot([r["tps_server"] for r in rs], [r["tps_user"] for r in rs], "o-", label=label)
    for r in rs:
      ax.annotate(str(r["users"]), (r["tps_server"], r["tps_user"]), fontsize=7)
  ax.set_xlabel("tokens/s per server")
  ax.set_ylabel("tokens/s per user")
  ax.set_xscale("log")
  ax.grid(alpha=0.3)
  ax.legend(title="speculation")
  ax.set_title("serve.py, embedded pair (labels: concurrent users)")
  fig.tight_layout()
  tmp = f"{path}.tmp-{os.getpid()}.png"
  fig.savefig(tmp, dpi=120)
  os.replace(tmp, path)


def main(argv):
  try:
    cli.start(argv)
    try:
      conc = [int(c) for c in _CONC.value]
    except ValueError:
      raise cli.UsageError(f"--concurrency: {_CONC.value} are not all integers") from None
    if not conc or min(conc) < 1:
      raise cli.UsageError(f"--concurrency: {_CONC.value} must be user counts >= 1")
    for m in _MODES.value:
      if m not in MODES:
        raise cli.UsageError(f"--modes: {m!r} is not one of {list(MODES)}")
    import jax
    device = jax.devices()[0].platform
    tree = _tree(device) if "tree" in _MODES.value else None
  except cli.UsageError as e:
    return cli.fail("serving", e)
  per_user = {u: max(_PER_USER.value, -(-_MIN_REQUESTS.value // u)) for u in conc}
  prompts = _prompts(max(u * per_user[u] for u in conc), _PROMPT_LEN.value)
  rows = []
  for mode in _MODES.value:
    proc, base = _serve(mode, max(conc), tree)
    try:
      for users in conc:  # warm-up: every level once, so each batch-bucket program has run
        asyncio.run(_level(base, users, prompts, 1))
      for users in conc:
        r = dict(mode=mode, tree=tree if mode == "tree" else None,
                 **asyncio.run(_level(base, users, prompts, per_user[users])))
        rows.append(r)
        print(json.dumps(r), flush=True)
    finally:
      proc.terminate()
      proc.wait(60)
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  stem = os.path.join(_OUT_DIR.value, f"serving_{device}")
  cli.write_atomic(stem + ".json", json.dumps(rows, indent=1))
  cli.write_atomic(stem + ".md", _report(rows, device, tree))
  _plot(rows, stem + ".png", tree)
  print(_report(rows, device, tree))
  return 0


if __name__ == "__main__":
  app.run(main)
