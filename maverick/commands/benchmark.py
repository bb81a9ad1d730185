"""Benchmark sweep: draft shapes x batch sizes x prompt/output lengths on a target + draft pair.

  python scripts/benchmark.py                                  # embedded model + its EAGLE-3 draft
  python scripts/benchmark.py --ks 0,3 --batch_sizes 1,8,32 --prompt_lens 128 --output_lens 256
  python scripts/benchmark.py --checkpoint /ckpt/maverick --draft /ckpt/maverick-eagle3 \\
      --trees 5x8x32,4x4x16 --profile_dir /tmp/trace

A "draft shape" is K = 0 (plain decoding), a chain K >= 1 (--ks), or a tree DEPTHxTOPKxNODES
(--trees). For every (batch, prompt length, output length, draft shape) it reports tokens/s in total
and per user, time to first token, acceptance length and per-position acceptance, the speed-up over
K = 0 measured in the same run, and compile time apart.

How it measures (two phases, so compilation never lands in a timed region):
  1. compile: one warm-up call per configuration compiles its program (the compile seconds come from
     the library, which compiles ahead of the call);
  2. timed: each configuration runs its --num_prompts held-out prompts (in batches of the batch
     size) --repeats times; the median wall time of a pass gives tokens/s. Stop tokens are off, so
     every row generates exactly the output length. TTFT is the median latency of a call with the
     same program in which every row stops at its first token (prefill + first token: what a
     streaming caller waits for).
     --profile_dir traces this phase only.
Prompts are the first N tokens of held-out Python stdlib files (the validation split the embedded
model never trained on). Writes <out_dir>/benchmark_<device>.{json,md} and two PNG plots.

Run as `maverick-benchmark` (an installed maverick-jax's console script), as
`python -m maverick.commands.benchmark`, or from a source checkout as
`python scripts/benchmark.py`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import statistics
import sys
import time

from absl import flags

from maverick import gpu_flags

gpu_flags.configure()  # before anything starts a jax backend (XLA reads XLA_FLAGS once)

from maverick import cli  # noqa: E402

_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", "tiny", "Target model: 'tiny' (embedded), a converted or Hugging Face directory, "
    "a Hugging Face repo id (needs huggingface_hub), or random:<preset>.")
_DRAFT = flags.DEFINE_string(
    "draft", None, "EAGLE-3 draft head (directory or repo id). Default: the embedded draft of an "
    "embedded target; none otherwise (then only K = 0 can run).")
_KS = flags.DEFINE_list("ks", ["0", "1", "2", "3", "4", "5"],
                        "Chain draft lengths K to sweep; 0 = plain decoding (the speed-up baseline,"
                        " always added).")
_TREES = flags.DEFINE_list(
    "trees", [], "Tree draft shapes DEPTHxTOPKxNODES, e.g. 5x8x32,4x4x16 (depth of the draft tree,"
    " children kept per node, tree nodes verified per round).")
_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "4"], "Batch sizes (users served at once).")
_PROMPT_LENS = flags.DEFINE_list("prompt_lens", ["64"], "Prompt lengths in tokens.")
_OUTPUT_LENS = flags.DEFINE_list("output_lens", ["64"], "Generated tokens per prompt.")
_NUM_PROMPTS = flags.DEFINE_integer(
    "num_prompts", 8, "Held-out prompts per configuration, run in batches of the batch size (every "
    "batch size sees the same prompts, so acceptance is comparable across rows).")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed passes per configuration (median reported).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                           "Compute/parameter dtype. Default: the checkpoint's.")
_OUT_DIR = flags.DEFINE_string("out_dir", cli.default_path("benchmarks", "results"),
                               "Where benchmark_<device>.{json,md} and the PNG plots go.")
_PROFILE_DIR = flags.DEFINE_string(
    "profile_dir", None, "If set, writes a jax.profiler trace of the timed phase here (open with "
    "TensorBoard / XProf or Perfetto).")
_KERNELS = cli.define_kernels_flag()
_KV_CACHE = cli.define_kv_cache_flag()
_PROGRESS = flags.DEFINE_bool("progress", True, "Show progress bars.")


@dataclasses.dataclass(frozen=True)
class DraftShape:
  """K = 0 (plain), a chain of K drafts, or a tree (depth x top-k children x verified nodes)."""
  k: int = 0
  topk: int = 0
  nodes: int = 0

  @property
  def is_tree(self) -> bool:
    return self.nodes > 0

  @property
  def label(self) -> str:
    return f"tree {self.k}x{self.topk}x{self.nodes}" if self.is_tree else f"K={self.k}"

  def to_json(self) -> dict:
    if self.is_tree:
      return {"kind": "tree", "depth": self.k, "topk": self.topk, "nodes": self.nodes}
    return {"kind": "plain" if self.k == 0 else "chain", "k": self.k}


def parse_positive_ints(values, flag: str, minimum: int = 1) -> list[int]:
  out = []
  for v in values:
    try:
      n = int(v)
    except ValueError:
      raise cli.UsageError(f"--{flag}: {v!r} is not an integer") from None
    if n < minimum:
      raise cli.UsageError(f"--{flag}: {n} must be >= {minimum}")
    out.append(n)
  if not out:
    raise cli.UsageError(f"--{flag} is empty; give at least one value")
  return sorted(set(out))


def parse_tree(text: str) -> DraftShape:
  """'5x8x32' -> DraftShape(depth 5, top-k 8, 32 nodes); spec_decode checks the node budget."""
  parts = text.lower().split("x")
  try:
    depth, topk, nodes = (int(p) for p in parts)
  except ValueError:
    raise cli.UsageError(f"--trees: {text!r} is not DEPTHxTOPKxNODES (e.g. 5x8x32)") from None
  if min(depth, topk, nodes) < 1 or nodes < depth:
    raise cli.UsageError(f"--trees: {text!r} needs depth, top-k >= 1 and nodes >= depth (a tree "
                         "verifies at least one token per level)")
  return DraftShape(depth, topk, nodes)


def draft_shapes(ks, trees) -> list[DraftShape]:
  chain = [DraftShape(k) for k in parse_positive_ints(ks, "ks", minimum=0)]
  if chain[0].k != 0:
    chain.insert(0, DraftShape(0))  # the baseline of every speed-up
  return chain + [parse_tree(t) for t in trees]


def make_runner(shape: DraftShape, target, draft, **kw):
  """fn(prompts, max_new_tokens, stop_tokens=()) -> Generation for one draft shape."""
  from maverick import generation
  import spec_decode
  if shape.k == 0:
    return lambda prompts, n, stop=(): generation.generate(target, prompts, max_new_tokens=n,
                                                         stop_tokens=stop, **kw)
  if draft is None:
    raise cli.UsageError(f"{shape.label} needs a draft head and {_CHECKPOINT.value!r} has no "
                         "embedded one: pass --draft, or --ks 0 to time plain decoding only")
  if shape.is_tree:
    return tree_runner(shape, target, draft, **kw)
  return lambda prompts, n, stop=(): spec_decode.generate(target, draft, prompts, k=shape.k,
                                                          max_new_tokens=n, stop_tokens=stop, **kw)


def tree_runner(shape: DraftShape, target, draft, **kw):
  """Tree drafting (issue 9): spec_decode.generate(..., tree=spec_decode.TreeShape(...))."""
  import spec_decode
  tree = spec_decode.TreeShape(depth=shape.k, topk=shape.topk, nodes=shape.nodes)
  return lambda prompts, n, stop=(): spec_decode.generate(target, draft, prompts, tree=tree,
                                                          max_new_tokens=n, stop_tokens=stop, **kw)


def held_out_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
  """The first `length` tokens of `n` held-out stdlib files (validation split)."""
  from maverick import data
  texts = data.load_split(None, "validation").texts
  prompts = []
  for text in texts:
    ids = tokenizer.encode(text[:max(64, 16 * length)])
    if len(ids) > length:
      prompts.append(ids[:length])
    if len(prompts) == n:
      return prompts
  raise cli.UsageError(f"only {len(prompts)} held-out files have more than {length} tokens, "
                       f"{n} needed; lower --prompt_lens or --num_prompts")


@dataclasses.dataclass
class Config:
  batch: int
  prompt_len: int
  output_len: int
  shape: DraftShape


def _median_pass(fn, groups, n, repeats):
  """Median seconds of one pass over all groups, and the outputs of the last pass (each call
  returns host arrays, so a pass ends when its last result is on the host)."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    outs = [fn(g, n) for g in groups]
    times.append(time.perf_counter() - start)
  return statistics.median(times), outs


def _median_first_token(fn, groups, outs, n, repeats):
  """Median latency of a call that stops every row after its first token.

  It reuses the compiled program of the timed run: each row's stop token is the first token that
  run produced (deterministic for a seed), so the call is prefill + first token and its loop exits
  at once. No second program, no second compile."""
  times = []
  stops = [[[row[0]] for row in o.tokens] for o in outs]
  for _ in range(repeats):
    for g, stop in zip(groups, stops):
      start = time.perf_counter()
      out = fn(g, n, stop)
      times.append(time.perf_counter() - start)
      if out.compile_seconds or int(out.num_tokens.max()) != 1:
        raise RuntimeError("the time-to-first-token call did not stop after one token with the "
                           "timed run's program; is generation deterministic for a seed?")
  return statistics.median(times)


def run_sweep(configs, loaded, draft, *, num_prompts, repeats, temperature, seed, progress,
              profile_dir=None) -> list[dict]:
  import jax
  from tqdm import tqdm
  kw = dict(temperature=temperature, seed=seed)  # no stop tokens: every row runs to the end
  runners = {s: make_runner(s, loaded.model, draft, **kw) for s in {c.shape for c in configs}}
  if max(c.batch for c in configs) > num_prompts:
    raise cli.UsageError(f"--num_prompts {num_prompts} is smaller than the largest batch size "
                         f"{max(c.batch for c in configs)}; raise --num_prompts")
  prompts = {p: held_out_prompts(loaded.tokenizer, num_prompts, p)
             for p in {c.prompt_len for c in configs}}

  def groups(c):  # whole batches only
    ps = prompts[c.prompt_len]
    return [ps[i:i + c.batch] for i in range(0, len(ps) - c.batch + 1, c.batch)]

  rows = []
  for c in tqdm(configs, desc="compiling", disable=not progress):
    first = runners[c.shape](groups(c)[0], c.output_len)
    rows.append({"batch": c.batch, "prompt_len": c.prompt_len, "output_len": c.output_len,
                 "draft": c.shape.label, "draft_shape": c.shape.to_json(),
                 "compile_seconds": first.compile_seconds})

  if profile_dir:
    jax.profiler.start_trace(profile_dir)
  try:
    for c, row in zip(tqdm(configs, desc="timing", disable=not progress), rows):
      fn = runners[c.shape]
      fn(groups(c)[0], c.output_len)  # untimed: caches and threads warm for this program
      seconds, outs = _median_pass(fn, groups(c), c.output_len, repeats)
      ttft_seconds = _median_first_token(fn, groups(c), outs, c.output_len, repeats)
      tokens = sum(int(o.num_tokens.sum()) for o in outs)
      row.update(tokens=tokens, seconds=seconds, tokens_per_second=tokens / seconds,
                 tokens_per_second_per_user=tokens / seconds / c.batch, ttft_seconds=ttft_seconds)
      if c.shape.k > 0:
        # Over all batches: each output's statistics weighted by its verify rounds.
        rounds = [int(o.rounds.sum()) for o in outs]
        row["rounds"] = sum(rounds)
        row["acceptance_length"] = sum(
            r * o.acceptance_length for r, o in zip(rounds, outs)) / sum(rounds)
        row["per_position_acceptance"] = [float(x) for x in sum(
            r * o.acceptance_rates for r, o in zip(rounds, outs)) / sum(rounds)]
  finally:
    if profile_dir:
      jax.profiler.stop_trace()

  for row in rows:
    base = next(r for r in rows if r["draft"] == "K=0" and all(
        r[f] == row[f] for f in ("batch", "prompt_len", "output_len")))
    row["speedup_vs_k0"] = row["tokens_per_second"] / base["tokens_per_second"]
  return rows


def markdown(res: dict) -> str:
  s = res["settings"]
  lines = [f"Device: {res['device']} x{res['device_count']} | target `{res['checkpoint']}` + draft "
           f"`{res['draft']}` | {s['num_prompts']} held-out prompts per row, temperature "
           f"{s['temperature']}, median of {s['repeats']} passes | `{res['command']}`", "",
           "| batch | prompt | output | draft | tokens/s | tokens/s/user | speed-up vs K=0 | "
           "TTFT ms | acceptance length | per-position acceptance | compile s |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    al = f"{r['acceptance_length']:.2f}" if "acceptance_length" in r else "-"
    pp = " ".join(f"{x:.2f}" for x in r.get("per_position_acceptance", [])) or "-"
    lines.append(
        f"| {r['batch']} | {r['prompt_len']} | {r['output_len']} | {r['draft']} | "
        f"{r['tokens_per_second']:.1f} | {r['tokens_per_second_per_user']:.1f} | "
        f"{r['speedup_vs_k0']:.2f}x | {1e3 * r['ttft_seconds']:.1f} | {al} | {pp} | "
        f"{r['compile_seconds']:.1f} |")
  return "\n".join(lines) + "\n"


def plot(res: dict, stem: str) -> list[str]:
  """<stem>_speedup.png (speed-up and acceptance length vs K) and <stem>_batch.png (tokens/s per
  user vs batch). Returns the paths written."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  rows = res["rows"]
  lengths = sorted({(r["prompt_len"], r["output_len"]) for r in rows})
  batches = sorted({r["batch"] for r in rows})
  title = f"{res['checkpoint']} on {res['device']}"

  fig, (ax_s, ax_a) = plt.subplots(1, 2, figsize=(10, 4))
  for p, o in lengths:
    for b in batches:
      sel = [r for r in rows if (r["prompt_len"], r["output_len"], r["batch"]) == (p, o, b)]
      chain = sorted((r for r in sel if r["draft_shape"]["kind"] != "tree"),
                     key=lambda r: r["draft_shape"]["k"])
      name = f"batch {b}" + (f", {p}->{o}" if len(lengths) > 1 else "")
      line, = ax_s.plot([r["draft_shape"]["k"] for r in chain],
                        [r["speedup_vs_k0"] for r in chain], "o-", label=name)
      spec = [r for r in chain if r["draft_shape"]["k"] > 0]
      ax_a.plot([r["draft_shape"]["k"] for r in spec], [r["acceptance_length"] for r in spec],
                "o-", color=line.get_color(), label=name)
      for r in sel:
        if r["draft_shape"]["kind"] == "tree":  # plotted at its depth
          d = r["draft_shape"]["depth"]
          ax_s.plot([d], [r["speedup_vs_k0"]], "*", ms=12, color=line.get_color())
          ax_s.annotate(r["draft"], (d, r["speedup_vs_k0"]), fontsize=7)
          if "acceptance_length" in r:
            ax_a.plot([d], [r["acceptance_length"]], "*", ms=12, color=line.get_color())
  ks = sorted({r["draft_shape"].get("k", 0) for r in rows if r["draft_shape"]["kind"] != "tree"})
  ax_s.axhline(1.0, color="gray", lw=0.8, ls="--")
  has_trees = any(r["draft_shape"]["kind"] == "tree" for r in rows)
  trees = " (trees: stars at their depth)" if has_trees else ""
  ax_s.set(xlabel="draft length K (0 = plain)" + trees, ylabel="speed-up vs K=0 (tokens/s)",
           title="Speed-up", xticks=ks)
  ax_a.plot(ks, [k + 1 for k in ks], ":", color="gray", label="ideal (K+1)")
  ax_a.set(xlabel="draft length K", ylabel="tokens per verify step", title="Acceptance length",
           xticks=ks)
  for ax in (ax_s, ax_a):
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  speed_png = _save(fig, stem + "_speedup.png")
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(5.5, 4))
  for label in dict.fromkeys(r["draft"] for r in rows):
    for p, o in lengths:
      sel = sorted((r for r in rows if r["draft"] == label and (r["prompt_len"], r["output_len"])
                    == (p, o)), key=lambda r: r["batch"])
      name = label + (f", {p}->{o}" if len(lengths) > 1 else "")
      ax.plot([r["batch"] for r in sel], [r["tokens_per_second_per_user"] for r in sel], "o-",
              label=name)
  ax.set(xlabel="batch size", ylabel="tokens/s per user", title=title, xticks=batches)
  if len(batches) > 1 and batches[-1] / batches[0] >= 8:
    ax.set_xscale("log", base=2)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  batch_png = _save(fig, stem + "_batch.png")
  plt.close(fig)
  return [speed_png, batch_png]


def _save(fig, path: str) -> str:
  tmp = f"{path}.tmp-{os.getpid()}"
  fig.savefig(tmp, dpi=110, format="png")
  os.replace(tmp, path)
  return path


def main(argv):  # Ctrl-C stops it at once, mid-compile too (cli.run_interruptibly)
  return cli.run_interruptibly("benchmark", _main, argv)


def _main(argv):
  try:
    cli.start(argv)
    shapes = draft_shapes(_KS.value, _TREES.value)
    batches = parse_positive_ints(_BATCHES.value, "batch_sizes")
    prompt_lens = parse_positive_ints(_PROMPT_LENS.value, "prompt_lens")
    output_lens = parse_positive_ints(_OUTPUT_LENS.value, "output_lens")
    if _NUM_PROMPTS.value < 1 or _REPEATS.value < 1:
      raise cli.UsageError("--num_prompts and --repeats must be >= 1")
  except cli.UsageError as e:
    return cli.fail("benchmark", e)
  import jax
  from maverick import loading
  import spec_decode
  from maverick import kernels as kernels_lib
  from maverick.checkpoint import CheckpointError
  from maverick.config import ConfigError
  from spec_decode.draft import DraftConfigError

  start = time.perf_counter()
  try:
    loaded = loading.load(_CHECKPOINT.value, dtype=_DTYPE.value, seed=_SEED.value,
                          kernels=cli.kernels_value(_KERNELS), kv_cache=_KV_CACHE.value)
    if loaded.tokenizer is None:
      raise cli.UsageError(f"{_CHECKPOINT.value} has no tokenizer.json (needed to encode the "
                           "held-out prompts); copy the model's tokenizer files next to it")
    draft_name = _DRAFT.value or (_CHECKPOINT.value if _CHECKPOINT.value in
                                  spec_decode.EMBEDDED_DRAFTS else None)
    draft = None
    if draft_name and any(s.k > 0 for s in shapes):
      draft = spec_decode.load_draft(draft_name, loaded.model, dtype=_DTYPE.value)
      kernels_lib.set_kernels(draft, cli.kernels_value(_KERNELS))
    configs = [Config(b, p, o, s) for p in prompt_lens for o in output_lens for b in batches
               for s in shapes]
    rows = run_sweep(configs, loaded, draft, num_prompts=_NUM_PROMPTS.value,
                     repeats=_REPEATS.value, temperature=_TEMPERATURE.value, seed=_SEED.value,
                     progress=_PROGRESS.value, profile_dir=_PROFILE_DIR.value)
  except (cli.UsageError, ValueError, FileNotFoundError, CheckpointError, ConfigError,
          DraftConfigError, NotImplementedError) as e:
    return cli.fail("benchmark", e)

  dev = jax.devices()[0]
  device = dev.device_kind.replace(" ", "_").lower()
  result = {
      "device": device, "platform": dev.platform, "device_count": jax.device_count(),
      "jax_version": jax.__version__, "kernels": _KERNELS.value, "checkpoint": _CHECKPOINT.value, "draft": draft_name,
      "command": " ".join(["python scripts/benchmark.py", *sys.argv[1:]]),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "settings": {"ks": [s.k for s in shapes if not s.is_tree],
                   "trees": [s.label for s in shapes if s.is_tree], "batch_sizes": batches,
                   "prompt_lens": prompt_lens, "output_lens": output_lens,
                   "num_prompts": _NUM_PROMPTS.value, "repeats": _REPEATS.value,
                   "temperature": _TEMPERATURE.value, "seed": _SEED.value, "dtype": _DTYPE.value},
      "total_seconds": None, "rows": rows}
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  stem = os.path.join(_OUT_DIR.value, f"benchmark_{device}")
  table = markdown(result)
  pngs = plot(result, stem)
  result["total_seconds"] = time.perf_counter() - start
  result["files"] = [os.path.basename(p) for p in (stem + ".json", stem + ".md", *pngs)]
  cli.write_atomic(stem + ".md", table)
  cli.write_atomic(stem + ".json", json.dumps(result, indent=1) + "\n")
  print(table)
  print(f"wrote {stem}.json, {stem}.md, {', '.join(pngs)} in {result['total_seconds']:.0f} s")
  if _PROFILE_DIR.value:
    print(f"profile of the timed phase: {_PROFILE_DIR.value}")
  return 0


console_main = cli.console_main(main, __name__)  # the console script `maverick-benchmark`

if __name__ == "__main__":
  console_main()
