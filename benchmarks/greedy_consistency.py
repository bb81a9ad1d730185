"""Greedy consistency: how often greedy text changes with the batch size, with speculation, and with
the serving engine's load, and whether every change sits at a near-tie of the f32 logits.

  python benchmarks/greedy_consistency.py                    # embedded model + draft, bf16 and f32
  python benchmarks/greedy_consistency.py --dtypes bfloat16 --num_prompts 16 --max_new_tokens 32

Prompt set: PROMPTS below, 64 fixed openings (English prose, questions, Python, C, SQL, shell; the
first --num_prompts are used), tokenized with the model's tokenizer. Every run is greedy with no
stop token, so each row has --max_new_tokens tokens. Runs, per dtype:
  plain_b1   maverick.generate, one prompt per call (the reference)
  plain_bN   maverick.generate, all prompts in one call
  k3, tree   spec_decode.generate, chain K=3 / EAGLE-2 tree --tree, all prompts in one call
  engine_1   the serving Engine (--engine_k), one request at a time: the batch-1 step program
  engine_32  the same engine, every request submitted at once: the batch-32 step program
Pairs: plain_bN vs plain_b1, k3 and tree vs plain_bN, engine_32 vs engine_1, and each run vs
plain_b1. For each row that differs: the first step where it does, and the top-2 gap of the f32
logits there from a plain full forward (one batch) of the prompt + the common prefix.

Near-tie bound (measured): plain_b1 and plain_bN run again with logprobs=2 give each program's own
top-2 logits (logprob differences of a greedy row = logit differences) at every step. Where that
program's prefix equals the reference, how far it moved the forward's top-2 gap (step_error) is
the reduction-order error of the logits across programs; the largest one seen is the bound, also
given in f32 ulps of the largest logit (the p99, and where the largest was, are reported too).
Two programs can only disagree where that error reaches the forward's gap, so a difference whose
forward gap is within the bound is a near-tie.
Results: benchmarks/results/greedy_consistency.{json,md}.
"""

import json
import os
import sys
import threading
import time

from absl import app
from absl import flags
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from maverick import cli  # noqa: E402  (after the sys.path line)


def define_flags():
  """The CLI's flags, defined only when run as a script: importing the module's helpers (the
  tests) must not define flags that other benchmarks' modules define too in the same process."""
  global _TARGET, _DTYPES, _NUM_PROMPTS, _NEW, _TREE, _ENGINE_K, _OUT_DIR
  _TARGET = flags.DEFINE_string("target", "tiny", "Target model with a tokenizer (see "
                                "scripts/generate.py); its embedded draft drives k3/tree/engine.")
  _DTYPES = flags.DEFINE_list("dtypes", ["bfloat16", "float32"], "Model dtypes, one pass each.")
  _NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 64, "The first N of PROMPTS (1..64).")
  _NEW = flags.DEFINE_integer("max_new_tokens", 40, "Greedy tokens per prompt.")
  _TREE = flags.DEFINE_string("tree", "3x2x5", "Tree shape DEPTHxTOPKxNODES of the tree run.")
  _ENGINE_K = flags.DEFINE_integer("engine_k", 3,
                                   "Draft tokens per round in the engine (0: plain).")
  _OUT_DIR = flags.DEFINE_string("out_dir", os.path.join(REPO, "benchmarks", "results"),
                                 "Where greedy_consistency.{json,md} go.")


PROMPTS = (
    "The capital of France is", "Once upon a time, in a small village,", "The best way to learn",
    "My favourite book is", "In 1969, the first humans", "The weather today is",
    "Dear Sir or Madam,\n", "Q: What is the boiling point of water?\nA:", "The cat sat on the",
    "Three things I learned this year:", "To make a cup of tea, first", "The meeting is moved to",
    "Photosynthesis is the process by which", "She opened the door and saw", "Breaking news:",
    "The quick brown fox", "def fibonacci(n):", "import numpy as np\n", "class Stack:\n",
    "for i in range(10):\n", "def add(a, b):\n    return", "x = [", "with open(path) as f:\n",
    "if __name__ == '__main__':\n", "#include <stdio.h>\n", "int main(void) {\n",
    "SELECT name, age FROM", "#!/bin/bash\n", "def quicksort(arr):\n", "import os\nimport sys\n",
    "try:\n    ", "lambda x:", "return ", "while True:\n", "async def fetch(url):\n",
    "from typing import List\n", "def __init__(self, name):\n", "print(", "raise ValueError(",
    "@dataclasses.dataclass\nclass Point:\n", "# Compute the mean of a list\n", "assert ",
    "for key, value in d.items():\n", "result = []\nfor x in data:\n", "def test_", "\"\"\"",
    "The function below", "git commit -m", "A list of prime numbers: 2, 3, 5,",
    "It was a dark and stormy night;", "The recipe calls for two cups of", "Hello, world",
    "The answer to the question is", "In summary, the results show", "First, install the",
    "Error: file not found", "The train leaves at", "She said that", "import json\n",
    "def main():\n", "if x > 0:\n", "elif", "The history of Rome", "Translate to French: cat ->",
)
assert len(PROMPTS) == 64 and len(set(PROMPTS)) == 64


# -------------------------------------------------------------------------------------------------
# Pure helpers (tests/test_greedy_consistency.py)
# -------------------------------------------------------------------------------------------------
def first_divergence(a, b):
  """The first index where token lists a and b differ (a shorter list differs where it ends), or
  None when they are equal."""
  for i, (x, y) in enumerate(zip(a, b)):
    if x != y:
      return i
  return None if len(a) == len(b) else min(len(a), len(b))


def top2(logits):
  """Top-2 of f32 logits [..., V] on the device (jax.lax.top_k: ties go to the lower id):
  (ids [..., 2], values [..., 2]) as NumPy, value order descending."""
  import jax
  import jax.numpy as jnp
  vals, ids = jax.lax.top_k(jnp.asarray(logits, jnp.float32), 2)
  return np.asarray(ids), np.asarray(vals)


def step_error(program_top, forward_ids, forward_gap):
  """How far one program's logits moved the forward's top-2 gap at a step: program_top is its
  `logprobs=2` alternatives [(id, logprob), (id, logprob)] (logprob differences of a greedy row are
  logit differences). With the same two tokens, the signed gap of the forward's pair (a flip
  counts the whole way); else the change of the top-1 - top-2 gap."""
  lp = dict(program_top)
  if set(lp) == {int(t) for t in forward_ids}:
    return abs((lp[int(forward_ids[0])] - lp[int(forward_ids[1])]) - forward_gap)
  return abs((program_top[0][1] - program_top[1][1]) - forward_gap)


def errors(forward, runs, reference):
  """step_error at every step where a run's prefix equals the reference's (the step where it
  diverges included), and where each was: (run, row, step). forward[r][s]: (top-2 ids, gap)
  before reference[r][s]; runs: [(tokens, logprobs)] with each row's `logprobs=2` output
  [(logprob, alternatives)] per token."""
  out, where = [], []
  for i, (tokens, logprobs) in enumerate(runs):
    for r, (toks, row) in enumerate(zip(tokens, logprobs)):
      d = first_divergence(toks, reference[r])
      n = len(toks) if d is None else d + 1
      out += [step_error(row[s][1], *forward[r][s]) for s in range(min(n, len(row)))]
      where += [(i, r, s) for s in range(min(n, len(row)))]
  return np.asarray(out, np.float64), where


# -------------------------------------------------------------------------------------------------
# Runs
# -------------------------------------------------------------------------------------------------
def _engine_runs(model, draft, prompts, n_new):
  """engine_1 and engine_32 outputs of one Engine (32 slots, step programs for batch 1 and 32)."""
  from maverick.serving import Engine
  engine = Engine(model, draft if _ENGINE_K.value else None, k=max(_ENGINE_K.value, 1), slots=32,
                  max_seq_len=max(map(len, prompts)) + n_new, rounds=4, min_bucket=16,
                  batch_buckets=[1], stop_tokens=[])
  engine.start()

  def run(group):
    out = [[] for _ in group]
    done = [threading.Event() for _ in group]
    for i, p in enumerate(group):
      def on_event(ev, i=i):
        out[i] += ev.tokens
        if ev.done:
          done[i].set()
      engine.submit(p, on_event, max_tokens=n_new, stop_tokens=[])
    for d in done:
      if not d.wait(1800):
        raise RuntimeError(f"an engine request did not finish: {engine.error!r}")
    return out

  try:
    one = [run([p])[0] for p in prompts]
    steps_1 = dict(engine.steps_by_batch)
    many = run(prompts)
  finally:
    engine.shutdown()
  assert steps_1[32] == 0 and engine.steps_by_batch[32] > 0, engine.steps_by_batch
  return one, many


def _forward_top2(model, sequences, positions):
  """Top-2 (ids, values) of a plain full forward's f32 logits at each of positions[i] of
  sequences[i] (right-padded into one [B, L] batch: the model is causal), and max |logit|."""
  import jax.numpy as jnp
  from flax import nnx
  from maverick import model as model_lib
  length = max(map(len, sequences))
  batch = np.zeros((len(sequences), length), np.int32)
  for i, s in enumerate(sequences):
    batch[i, :len(s)] = s
  logits = model_lib.apply(*nnx.split(model), jnp.asarray(batch)).logits
  ids, vals = top2(logits)
  return ([ids[i, p] for i, p in enumerate(positions)], [vals[i, p] for i, p in
                                                          enumerate(positions)],
          float(jnp.abs(logits).max()))


def _one_dtype(dtype, n_prompts, n_new, log):
  import maverick
  import spec_decode
  loaded = maverick.load(_TARGET.value, dtype=dtype)
  model, tok = loaded.model, loaded.tokenizer
  draft = spec_decode.load_draft(_TARGET.value, model, dtype=dtype)
  prompts = [tok.encode(p) for p in PROMPTS[:n_prompts]]
  kw = dict(max_new_tokens=n_new, stop_tokens=[])
  start = time.perf_counter()
  runs = {}
  log(f"{dtype}: plain_b1")
  runs["plain_b1"] = [maverick.generate(model, [p], **kw).tokens[0] for p in prompts]
  log(f"{dtype}: plain_bN")
  runs["plain_bN"] = maverick.generate(model, prompts, **kw).tokens
  log(f"{dtype}: k3, tree")
  runs["k3"] = spec_decode.generate(model, draft, prompts, k=3, **kw).tokens
  runs["tree"] = spec_decode.generate(model, draft, prompts, tree=_TREE.value, **kw).tokens
  log(f"{dtype}: engine_1, engine_32")
  runs["engine_1"], runs["engine_32"] = _engine_runs(model, draft, prompts, n_new)

  # The programs' own gaps, for the measured bound.
  log(f"{dtype}: gaps (logprobs=2 runs, forward)")
  lp1 = [maverick.generate(model, [p], logprobs=2, **kw) for p in prompts]
  lpn = maverick.generate(model, prompts, logprobs=2, **kw)
  ref = runs["plain_b1"]
  steps = np.arange(n_new)
  ids, vals, logit_max = _forward_top2(model, [p + t for p, t in zip(prompts, ref)],
                                       [len(p) - 1 + steps for p in prompts])
  forward = [[(i, float(v[0] - v[1])) for i, v in zip(row_ids, row_vals)]
             for row_ids, row_vals in zip(ids, vals)]
  errs, where = errors(forward, [([o.tokens[0] for o in lp1], [o.logprobs[0] for o in lp1]),
                          (lpn.tokens, lpn.logprobs)], ref)
  gaps = [g for row in forward for _, g in row]
  bound, p99 = float(errs.max()), float(np.quantile(errs, 0.99))
  worst = where[int(errs.argmax())]
  ulp = float(np.spacing(np.float32(logit_max)))

  pairs = [("plain_bN", "plain_b1"), ("k3", "plain_bN"), ("tree", "plain_bN"),
           ("engine_32", "engine_1")] + [(name, "plain_b1") for name in runs if name != "plain_b1"]
  pairs = list(dict.fromkeys(pairs))
  found = []  # (pair index, row, step)
  for i, (a, b) in enumerate(pairs):
    for r in range(len(prompts)):
      d = first_divergence(runs[a][r], runs[b][r])
      if d is not None:
        found.append((i, r, d))
  diffs = [[] for _ in pairs]
  if found:
    ids, vals, _ = _forward_top2(
        model, [prompts[r] + runs[pairs[i][0]][r][:d] for i, r, d in found],
        [len(prompts[r]) - 1 + d for _, r, d in found])
    for (i, r, d), top_ids, top_vals in zip(found, ids, vals):
      a, b = pairs[i]
      gap = float(top_vals[0] - top_vals[1])
      diffs[i].append({"prompt": r, "step": d, "tokens": [runs[a][r][d], runs[b][r][d]],
                       "forward_top2": top_ids.tolist(), "gap": gap,
                       "top2_pair": sorted(top_ids.tolist()) == sorted([runs[a][r][d],
                                                                         runs[b][r][d]]),
                       "near_tie": gap <= bound, "within_p99": gap <= p99})
  return {"dtype": dtype, "seconds": time.perf_counter() - start,
          "bound": bound, "bound_ulps": bound / ulp, "logit_max": logit_max, "ulp": ulp,
          "errors_median": float(np.median(errs)), "errors_p99": p99,
          "worst": {"run": ["plain_b1", "plain_bN"][worst[0]], "prompt": worst[1],
                    "step": worst[2], "forward_gap": forward[worst[1]][worst[2]][1]},
          "error_samples": int(errs.size), "gaps_median": float(np.median(gaps)),
          "gaps_below_bound": int(sum(g <= bound for g in gaps)), "reference_steps": len(gaps),
          "gaps_below_p99": int(sum(g <= p99 for g in gaps)),
          "pairs": [{"runs": list(p), "rows": len(prompts), "differ": len(d), "near_ties":
                     sum(x["near_tie"] for x in d), "within_p99": sum(x["within_p99"] for x in d),
                     "differences": d}
                    for p, d in zip(pairs, diffs)]}


def main(argv):  # Ctrl-C stops it at once, mid-compile too (cli.run_interruptibly)
  return cli.run_interruptibly("greedy_consistency", _main, argv)


def _main(argv):
  try:
    cli.start(argv)
    if not 1 <= _NUM_PROMPTS.value <= len(PROMPTS):
      raise cli.UsageError(f"--num_prompts must be in [1, {len(PROMPTS)}], got "
                           f"{_NUM_PROMPTS.value}")
    if _NEW.value < 1 or _ENGINE_K.value < 0:
      raise cli.UsageError("--max_new_tokens must be >= 1 and --engine_k >= 0")
  except cli.UsageError as e:
    return cli.fail("greedy_consistency", e)
  import jax
  log = lambda what: print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)
  result = {"device": jax.devices()[0].platform, "target": _TARGET.value,
            "command": "python benchmarks/greedy_consistency.py " + " ".join(sys.argv[1:]),
            "prompts": _NUM_PROMPTS.value, "max_new_tokens": _NEW.value, "tree": _TREE.value,
            "engine_k": _ENGINE_K.value,
            "results": [_one_dtype(d, _NUM_PROMPTS.value, _NEW.value, log) for d in _DTYPES.value]}
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  stem = os.path.join(_OUT_DIR.value, "greedy_consistency")
  with open(stem + ".json", "w") as f:
    json.dump(result, f, indent=1)
  table = markdown(result)
  with open(stem + ".md", "w") as f:
    f.write(table)
  print(table)
  return 0


def markdown(res):
  lines = [f"Device: {res['device']} | target {res['target']} + its EAGLE-3 draft | "
           f"{res['prompts']} prompts (benchmarks/greedy_consistency.py PROMPTS) x "
           f"{res['max_new_tokens']} greedy tokens, no stop token | tree {res['tree']}, engine "
           f"K={res['engine_k']} | `{res['command'].strip()}`", ""]
  for r in res["results"]:
    w = r["worst"]
    lines += [f"**{r['dtype']}** weights and activations (f32 logits). Reduction-order error of "
              f"the top-2 gap (plain programs at batch 1 and {res['prompts']} vs a full forward, "
              f"{r['error_samples']} steps): median {r['errors_median']:.2e}, p99 "
              f"{r['errors_p99']:.2e}, max {r['bound']:.2e} = the near-tie bound "
              f"({r['bound_ulps']:.0f} f32 ulps of the largest logit, {r['logit_max']:.1f}; the max "
              f"at {w['run']} prompt {w['prompt']} step {w['step']}, forward gap "
              f"{w['forward_gap']:.2e}). Median top-2 gap {r['gaps_median']:.3f}; of "
              f"{r['reference_steps']} reference steps, {r['gaps_below_bound']} have a gap within "
              f"the bound, {r['gaps_below_p99']} within the p99.", "",
              "| runs | rows that differ | near-ties (gap <= max error) | gap <= p99 error | "
              "differences: prompt@step gap (* = not a near-tie) |", "|---|---|---|---|---|"]
    for p in r["pairs"]:
      d = " ".join(f"{x['prompt']}@{x['step']} {x['gap']:.2e}{'' if x['near_tie'] else '*'}"
                   for x in p["differences"]) or "-"
      lines.append(f"| {p['runs'][0]} vs {p['runs'][1]} | {p['differ']} / {p['rows']} | "
                   f"{p['near_ties']} | {p['within_p99']} | {d} |")
    lines.append("")
  return "\n".join(lines)


if __name__ == "__main__":
  define_flags()
  app.run(main)
