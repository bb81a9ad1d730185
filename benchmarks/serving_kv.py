"""Paged KV benchmark (issue 29): capacity and tokens/s at a fixed KV budget, and prefix-cache TTFT.

  python benchmarks/serving_kv.py                      # both parts, plain decoding (+ --spec_k 3)

Drives maverick.serving.Engine in-process (no HTTP), greedy, the embedded model, every program
compiled and run once before anything is timed.

capacity: one KV budget for three engines, --max_seq_len = capacity - slack so a contiguous row is
a whole number of --block_size blocks. Budget = 8 rows of it (what the contiguous engine needs for
8 slots), the same number of blocks per pool for the paged engines:
  - contiguous: slots=8;
  - paged: slots=--paged_slots, num_blocks = the budget, chunk_local=False (one pool for all
    layers, nothing released before a request ends);
  - paged + chunk-local: the same, chunk-local layers in a pool of their own that releases blocks
    before the current chunk.
  Both paged engines also compile step programs over narrower block tables (--table_widths, in
  blocks) and run the narrowest that holds the running rows' blocks; every engine moves a long
  request left alone in a high slot down (serving/compaction.py; on by default on CPU only).
The mix (`mix`): --requests requests, all queued at t=0, seed --seed: prompt lengths lognormal
(median --prompt_median, sigma --sigma) rounded and clipped to [16, max_seq_len / 2], output
lengths lognormal (median --output_median, sigma --sigma) clipped to [4, max_seq_len / 2] and to
what the row leaves; no stop token (every request generates its full length). Prompts are slices
of the embedded model's held-out stdlib text. Reported per engine: the most requests running at
once (Engine.peak_active), tokens/s per server (all generated tokens / wall time from the first
submit to the last token), the most blocks in use per pool.

prefix: TTFT (submit -> first token event) of a shared --system_len-token system prompt + a
distinct 24-token user suffix, one request at a time, on a paged engine with the prefix cache off
and on; the first request of the timed system prompt fills the cache, the median is over the
--ttft_requests after it (hits). A different system prompt warms every program first.

The embedded model's context is 512 tokens; --max_seq_len past it raises the model's
max_position_embeddings for this run (the chunk-local layers' RoPE and the NoPE layers compute any
position alike: the cost is that of a longer-context model; text past 512 tokens is off-domain).
Results: benchmarks/results/serving_kv_<device>.{json,md,png}.
"""

import dataclasses
import gc
import json
import os
import statistics
import sys
import threading
import time

from absl import app
from absl import flags
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from maverick import cli  # noqa: E402  (after the sys.path line)

PARTS = ("capacity", "prefix")
CONTIGUOUS_SLOTS = 8
SUFFIX_LEN = 24  # + the 1000-token system prompt = the 1024 prompt bucket, no padding


@dataclasses.dataclass
class Setup:
  """What the flags set (see define_flags); batch_buckets: slots -> the engines' batch buckets
  (None: the engine's default, powers of two)."""
  parts: tuple = PARTS
  spec_k: tuple = (0,)
  capacity: int = 2048
  block_size: int = 64
  paged_slots: int = 64
  requests: int = 128
  seed: int = 0
  prompt_median: int = 100
  output_median: int = 64
  sigma: float = 1.0
  rounds: int = 8
  min_bucket: int = 16
  system_len: int = 1000
  ttft_requests: int = 8
  out_dir: str = os.path.join(REPO, "benchmarks", "results")
  batch_buckets: object = None
  table_widths: tuple = (4, 8, 16)


def mix(n: int, max_seq_len: int, seed: int, prompt_median: float, output_median: float,
        sigma: float) -> list[tuple[int, int]]:
  """(prompt length, output length) of n requests; see the module docstring."""
  rng = np.random.default_rng(seed)
  half = max_seq_len // 2
  prompts = np.clip(np.rint(rng.lognormal(np.log(prompt_median), sigma, n)), 16, half)
  outputs = np.clip(np.rint(rng.lognormal(np.log(output_median), sigma, n)), 4, half)
  outputs = np.minimum(outputs, max_seq_len - prompts)
  return [(int(p), int(o)) for p, o in zip(prompts, outputs)]


def text_tokens(loaded, n: int) -> np.ndarray:
  """n tokens of the embedded model's held-out stdlib text (documents joined, in file order)."""
  from maverick import data
  val = data.load_split(None, "validation")
  docs = data.encode_documents(loaded.tokenizer.hf_tokenizer, val.texts, loaded.tokenizer.bos_id)
  stream = np.concatenate(docs)
  if len(stream) < n:
    stream = np.tile(stream, -(-n // len(stream)))
  return stream[:n]


def extend_context(model, n: int) -> None:
  """Lets the engine take rows of n positions on a model trained on fewer (module docstring): the
  target, or an EAGLE-3 draft (whose decoder layer's config holds the context)."""
  cfg = model.config
  if hasattr(cfg, "layer"):  # Eagle3Config
    if n > cfg.layer.max_position_embeddings:
      model.config = dataclasses.replace(
          cfg, layer=cfg.layer.replace(max_position_embeddings=n))
  elif n > cfg.max_position_embeddings:
    model.config = cfg.replace(max_position_embeddings=n)


def _drive(engine, requests, on_step=None) -> dict:
  """Submits every (prompt, max_tokens) at once; waits for all; wall time and tokens."""
  done, lock = threading.Event(), threading.Lock()
  left, tokens, first = [len(requests)], [0], {}
  steps = [-1]

  def callback(i, start):
    def on_event(ev):
      if on_step is not None and engine.steps != steps[0]:
        steps[0] = engine.steps
        on_step(engine)
      with lock:
        tokens[0] += len(ev.tokens)
        if ev.tokens and i not in first:
          first[i] = ev.time - start
        if ev.done:
          left[0] -= 1
          if ev.finish_reason == "error" or not left[0]:
            done.set()
    return on_event

  start = time.perf_counter()
  for i, (prompt, n) in enumerate(requests):
    engine.submit(prompt, callback(i, time.perf_counter()), max_tokens=n)
  if not done.wait(3600) or engine.error is not None:
    raise RuntimeError(f"the engine failed or hung: {engine.error!r}")
  wall = max(time.perf_counter() - start, 1e-9)
  return dict(wall_s=wall, tokens=tokens[0], ttft_s=[first.get(i) for i in range(len(requests))])


def _engine(s, loaded, draft, k, **kw):
  from maverick.serving import Engine
  buckets = None if s.batch_buckets is None else s.batch_buckets(kw["slots"])
  e = Engine(loaded.model, draft, k=k or 3, rounds=s.rounds, min_bucket=s.min_bucket,
             stop_tokens=[], batch_buckets=buckets, **kw)
  e.compile()
  e.start()
  return e


LAYOUTS = {
    "contiguous": lambda blocks: dict(slots=CONTIGUOUS_SLOTS),
    "paged": lambda blocks: dict(kv_layout="paged", num_blocks=blocks, chunk_local=False),
    "paged + chunk-local": lambda blocks: dict(kv_layout="paged", num_blocks=blocks),
}


def capacity(s: "Setup", loaded, draft, k: int, tokens: np.ndarray) -> list[dict]:
  """The capacity part for one speculative mode: a row per layout (module docstring)."""
  bs, cap = s.block_size, s.capacity
  max_seq_len = cap - (k + 1 if k else 1)
  budget = CONTIGUOUS_SLOTS * cap // bs  # blocks per pool = 8 contiguous rows
  lengths = mix(s.requests, max_seq_len, s.seed, s.prompt_median,
                s.output_median, s.sigma)
  reqs = [(tokens[(37 * i) % (len(tokens) - p):][:p].tolist(), o)
          for i, (p, o) in enumerate(lengths)]
  rows = []
  for name, layout in LAYOUTS.items():
    kw = layout(budget)
    kw.setdefault("slots", s.paged_slots)
    if "kv_layout" in kw:
      kw["block_size"] = bs
      kw["table_widths"] = tuple(w for w in s.table_widths if w < cap // bs)
    e = _engine(s, loaded, draft, k, max_seq_len=max_seq_len, **kw)
    try:
      assert e.capacity == cap, (e.capacity, cap)  # a row is exactly cap / bs blocks
      # Warm-up: every batch bucket and prompt bucket has run once (not timed).
      for b in e.buckets:  # each prompt bucket, then the largest batch of short requests
        _drive(e, [(tokens[:min(b, max_seq_len - 4)].tolist(), 4)])
      _drive(e, [(tokens[i:i + 16].tolist(), 4) for i in range(e.slots)])
      e.peak_active = 0
      peak = {}

      def on_step(engine):
        for key, v in engine.kv_stats().items():
          if key.endswith("_blocks_used"):
            peak[key] = max(peak.get(key, 0), v)
      rounds0, accepted0, steps0 = e.spec_rounds, e.spec_accepted, e.steps
      r = _drive(e, reqs, on_step)
    finally:
      e.shutdown()
    assert r["tokens"] == sum(o for _, o in lengths), "every request generates its full length"
    row = dict(spec_k=k, layout=name, slots=e.slots, budget_blocks=budget, block_size=bs,
               max_seq_len=max_seq_len, requests=len(reqs), tokens=r["tokens"],
               wall_s=r["wall_s"], tps_server=r["tokens"] / r["wall_s"],
               max_concurrent=e.peak_active, steps=e.steps - steps0,
               peak_blocks_used=peak, preemptions=e.preemptions,
               acceptance=((e.spec_accepted - accepted0) / (e.spec_rounds - rounds0)
                           if k and e.spec_rounds > rounds0 else None))
    rows.append(row)
    print(json.dumps(row), flush=True)
    # Frees this engine's executables before the next one compiles: with a draft, three engines'
    # programs in one process ran out of LLVM's code mappings (a crash, not an exception).
    del e
    gc.collect()
  return rows


def prefix(s: "Setup", loaded, tokens: np.ndarray) -> list[dict]:
  """The prefix part: TTFT with the prefix cache off and on (module docstring)."""
  bs, cap, n = s.block_size, s.capacity, s.system_len
  max_seq_len = cap - 1
  warm_sys, timed_sys = tokens[:n].tolist(), tokens[n:2 * n].tolist()
  suffixes = [tokens[2 * n + SUFFIX_LEN * i:][:SUFFIX_LEN].tolist()
              for i in range(s.ttft_requests + 4)]
  rows = []
  for cache in (False, True):
    e = _engine(s, loaded, None, 0, slots=2, max_seq_len=max_seq_len, kv_layout="paged",
                block_size=bs, prefix_cache=cache)
    try:
      for tail in suffixes[-3:]:  # warm-up: the miss's and the hits' programs, another prefix
        _drive(e, [(warm_sys + tail, 4)])
      ttft = [_drive(e, [(timed_sys + tail, 4)])["ttft_s"][0]
              for tail in suffixes[:s.ttft_requests + 1]]
      stats = e.kv_stats()
    finally:
      e.shutdown()
    row = dict(prefix_cache=cache, system_len=n, suffix_len=SUFFIX_LEN, max_seq_len=max_seq_len,
               block_size=bs, first_ttft_s=ttft[0], ttft_s=ttft[1:],
               median_ttft_s=statistics.median(ttft[1:]),
               prefix_hit_rate=stats["prefix_hit_rate"])
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def summary(cap_rows, prefix_rows) -> dict:
  """The acceptance ratios: paged + chunk-local / contiguous (concurrency, tokens/s) per mode,
  and TTFT off / on."""
  out = {}
  for k in dict.fromkeys(r["spec_k"] for r in cap_rows):
    by = {r["layout"]: r for r in cap_rows if r["spec_k"] == k}
    base = by["contiguous"]
    for name in ("paged", "paged + chunk-local"):
      out[f"k{k} {name} concurrency x"] = by[name]["max_concurrent"] / base["max_concurrent"]
      out[f"k{k} {name} tokens/s x"] = by[name]["tps_server"] / base["tps_server"]
  if prefix_rows:
    off, on = (next(r for r in prefix_rows if r["prefix_cache"] == c) for c in (False, True))
    out["ttft off/on x"] = off["median_ttft_s"] / on["median_ttft_s"]
  return out


def _host() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      model = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
  except (OSError, StopIteration):
    model = "unknown CPU"
  return f"{model}, {os.cpu_count()} cores"


def report(results, device) -> str:
  lines = [f"# Paged KV serving benchmark ({device}; host {_host()})", "",
           "`python benchmarks/serving_kv.py " + " ".join(results["argv"]) + "`", "",
           results["setup"], ""]
  if results["capacity"]:
    lines += ["| spec K | layout | slots | KV budget (blocks/pool) | max concurrent | "
              "tokens/s per server | peak blocks used | wall (s) | acceptance |",
              "|---:|---|---:|---:|---:|---:|---|---:|---:|"]
    for r in results["capacity"]:
      used = ", ".join(f"{k.split('_')[0]} {v}" for k, v in r["peak_blocks_used"].items())
      acc = f"{r['acceptance']:.2f}" if r["acceptance"] else "-"
      lines.append(f"| {r['spec_k']} | {r['layout']} | {r['slots']} | {r['budget_blocks']} | "
                   f"{r['max_concurrent']} | {r['tps_server']:.1f} | {used or '-'} | "
                   f"{r['wall_s']:.1f} | {acc} |")
    lines.append("")
  if results["prefix"]:
    lines += ["| prefix cache | TTFT median on a hit (s) | TTFT first request (s) | "
              "prefix hit rate |", "|---|---:|---:|---:|"]
    for r in results["prefix"]:
      lines.append(f"| {'on' if r['prefix_cache'] else 'off'} | {r['median_ttft_s']:.4f} | "
                   f"{r['first_ttft_s']:.4f} | {r['prefix_hit_rate']:.2f} |")
    lines.append("")
  lines += ["| ratio | value |", "|---|---:|"]
  lines += [f"| {k} | {v:.2f} |" for k, v in results["summary"].items()]
  return "\n".join(lines) + "\n"


def plot(results, path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  panels = [p for p in ("capacity", "prefix") if results[p]]
  fig, axes = plt.subplots(1, len(panels) + (1 if results["capacity"] else 0),
                           figsize=(4.2 * (len(panels) + 1), 3.8), squeeze=False)
  axes = list(axes[0])
  if results["capacity"]:
    rows = results["capacity"]
    labels = [f"{r['layout']}" + (f"\nK={r['spec_k']}" if r["spec_k"] else "") for r in rows]
    for ax, key, title in ((axes.pop(0), "max_concurrent", "max concurrent requests"),
                           (axes.pop(0), "tps_server", "tokens/s per server")):
      ax.bar(range(len(rows)), [r[key] for r in rows], color=["C0", "C1", "C2"] * len(rows))
      ax.set_xticks(range(len(rows)), labels, fontsize=7)
      ax.set_title(f"{title}\n(same KV budget)", fontsize=9)
  if results["prefix"]:
    ax = axes.pop(0)
    rows = results["prefix"]
    ax.bar([0, 1], [1e3 * r["median_ttft_s"] for r in rows], color=["C3", "C2"])
    ax.set_xticks([0, 1], ["prefix cache off", "on (hit)"], fontsize=8)
    ax.set_ylabel("ms")
    ax.set_title(f"TTFT, {rows[0]['system_len']}-token shared prefix", fontsize=9)
  fig.tight_layout()
  tmp = f"{path}.tmp-{os.getpid()}.png"
  fig.savefig(tmp, dpi=110)
  os.replace(tmp, path)


def setup_text(s: Setup) -> str:
  return (f"Embedded model, greedy, no stop token, --rounds {s.rounds}. KV budget: "
          f"{CONTIGUOUS_SLOTS} rows of {s.capacity} positions = "
          f"{CONTIGUOUS_SLOTS * s.capacity // s.block_size} blocks of {s.block_size} per pool. "
          f"Mix: {s.requests} requests queued at t=0, seed {s.seed}, prompt ~ lognormal(median "
          f"{s.prompt_median}, sigma {s.sigma}) rounded, in [16, max_seq_len/2], output ~ "
          f"lognormal(median {s.output_median}, sigma {s.sigma}) rounded, in [4, max_seq_len/2]. "
          f"Prefix part: {s.system_len}-token system prompt + {SUFFIX_LEN}-token suffix, 4 new "
          f"tokens, median of {s.ttft_requests} hits. Paged step programs over tables of "
          f"{', '.join(map(str, s.table_widths))} blocks besides the whole row.")


def run(s: Setup, argv=()) -> dict:
  """Both parts as `s` says; writes serving_kv_<device>.{json,md,png} under s.out_dir."""
  import jax
  import maverick
  import spec_decode
  device = jax.devices()[0].platform
  loaded = maverick.load("tiny")
  extend_context(loaded.model, s.capacity)
  tokens = text_tokens(loaded, 4 * s.capacity)
  cap_rows = []
  if "capacity" in s.parts:
    for k in s.spec_k:
      draft = spec_decode.load_draft("tiny", loaded.model) if k else None
      if draft is not None:
        extend_context(draft, s.capacity)
      cap_rows += capacity(s, loaded, draft, k, tokens)
  prefix_rows = prefix(s, loaded, tokens) if "prefix" in s.parts else []
  results = dict(device=device, host=_host(), argv=list(argv), setup=setup_text(s),
                 capacity=cap_rows, prefix=prefix_rows, summary=summary(cap_rows, prefix_rows))
  os.makedirs(s.out_dir, exist_ok=True)
  stem = os.path.join(s.out_dir, f"serving_kv_{device}")
  cli.write_atomic(stem + ".json", json.dumps(results, indent=1))
  cli.write_atomic(stem + ".md", report(results, device))
  plot(results, stem + ".png")
  print(report(results, device))
  return results


def main(argv):  # Ctrl-C stops it at once, mid-compile too (cli.run_interruptibly)
  return cli.run_interruptibly("serving_kv", _main, argv)


def _main(argv):
  F = flags.FLAGS
  try:
    cli.start(argv)
    for p in F.parts:
      if p not in PARTS:
        raise cli.UsageError(f"--parts: {p!r} is not one of {list(PARTS)}")
    try:
      modes = tuple(int(k) for k in F.spec_k)
    except ValueError:
      raise cli.UsageError(f"--spec_k: {F.spec_k} are not all integers") from None
    try:
      widths = tuple(int(w) for w in F.table_widths)
    except ValueError:
      raise cli.UsageError(f"--table_widths: {F.table_widths} are not all integers") from None
    if any(w < 1 for w in widths):
      raise cli.UsageError(f"--table_widths: {list(widths)} must be >= 1 (blocks)")
    if any(k < 0 for k in modes):
      raise cli.UsageError(f"--spec_k: {list(modes)} must be >= 0 (0 = plain decoding)")
    if F.capacity % F.block_size or F.capacity < 4 * F.block_size:
      raise cli.UsageError(f"--capacity ({F.capacity}) must be a multiple of --block_size "
                           f"({F.block_size}), 4 blocks at least")
    if "prefix" in F.parts and F.system_len + SUFFIX_LEN + 4 >= F.capacity:
      raise cli.UsageError(f"--system_len {F.system_len} + {SUFFIX_LEN} + 4 tokens do not fit "
                           f"--capacity {F.capacity}")
  except cli.UsageError as e:
    return cli.fail("serving_kv", e)
  s = Setup(**{f.name: F[f.name].value for f in dataclasses.fields(Setup)
               if f.name not in ("spec_k", "batch_buckets", "parts", "table_widths")},
            parts=tuple(F.parts), spec_k=modes, table_widths=widths)
  run(s, sys.argv[1:])  # as typed: absl has taken the flags out of argv
  return 0


def define_flags():
  """The script's flags, defined only when run as a script: a test imports the functions, and
  these names would clash with other benchmarks' flags in its process."""
  d = Setup()
  flags.DEFINE_list("parts", list(PARTS), f"Of {list(PARTS)}.")
  flags.DEFINE_list("spec_k", ["0"], "Speculative modes of the capacity part: 0 = plain decoding, "
                    "K = an EAGLE-3 chain of K drafts (the embedded draft).")
  flags.DEFINE_integer("capacity", d.capacity, "Positions of a contiguous row (max_seq_len + the "
                       "round's slack); a multiple of --block_size.")
  flags.DEFINE_integer("block_size", d.block_size, "Positions per KV block.")
  flags.DEFINE_integer("paged_slots", d.paged_slots, "Slots (the batch) of the paged engines.")
  flags.DEFINE_integer("requests", d.requests, "Requests of the mix.")
  flags.DEFINE_integer("seed", d.seed, "Seed of the mix.")
  flags.DEFINE_integer("prompt_median", d.prompt_median, "Median prompt length.")
  flags.DEFINE_integer("output_median", d.output_median, "Median output length.")
  flags.DEFINE_float("sigma", d.sigma, "Sigma of both lognormals (the tail).")
  flags.DEFINE_integer("rounds", d.rounds, "Engine rounds per device call.")
  flags.DEFINE_integer("min_bucket", d.min_bucket, "Smallest prompt bucket.")
  flags.DEFINE_integer("system_len", d.system_len, "Shared system prompt tokens (prefix part).")
  flags.DEFINE_integer("ttft_requests", d.ttft_requests, "Timed prefix-hit requests.")
  flags.DEFINE_list("table_widths", [str(w) for w in d.table_widths], "Block-table widths "
                    "(blocks per row) the paged engines compile step programs for besides the "
                    "whole row (Engine(table_widths=...)); those under capacity/block_size are "
                    "used.")
  flags.DEFINE_string("out_dir", d.out_dir, "Where the JSON, Markdown and PNG results go.")


if __name__ == "__main__":
  define_flags()
  app.run(main)
