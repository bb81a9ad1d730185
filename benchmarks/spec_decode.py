"""Speculative decoding benchmark: K = 0 (plain) .. 5 and draft trees on the shipped target + draft.

  python benchmarks/spec_decode.py                      # batch 1 and 4, K = 0..5 + trees, greedy
  python benchmarks/spec_decode.py --batch_sizes 1 --ks 0,3 --trees 5x8x32 --max_new_tokens 64

Prompts are the first --prompt_len tokens of held-out stdlib files (the validation split). For each
(batch, K) the program is compiled first (compile time reported apart), then every prompt group is
generated --repeats times; tokens/s is the median over repeats of generated tokens / wall time.
Speed-ups are against K = 0 in the same run. For K = 3 at batch 1 it also times the pieces of a round
in isolation (target verify of K+1 tokens, draft extend + chain, the rest = acceptance and
bookkeeping). Results go to benchmarks/results/spec_decode_<device>.{json,md}.
"""

import dataclasses
import json
import os
import statistics
import sys
import time

from absl import app
from absl import flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Per-op trace events on XLA:CPU, for the profiled round breakdown (no cost while not tracing).
_TRACEME = "--xla_cpu_enable_xprof_traceme=true"
if _TRACEME not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _TRACEME).strip()
sys.path.insert(0, REPO)

from maverick import cli  # noqa: E402  (after the sys.path line)

_TARGET = flags.DEFINE_string("target", "tiny", "Target model (see scripts/generate.py).")
_DRAFT = flags.DEFINE_string("draft", None, "Draft head (default: the target's embedded draft).")
_BATCHES = flags.DEFINE_list("batch_sizes", ["1", "4"], "Batch sizes.")
_KS = flags.DEFINE_list("ks", ["0", "1", "2", "3", "4", "5"], "Draft lengths (0 = plain).")
_TREES = flags.DEFINE_list(
    "trees", ["3x1x3", "4x2x8", "4x4x12", "5x4x16", "5x8x32", "6x8x48"],
    "EAGLE-2 dynamic tree shapes DEPTHxTOPKxNODES (3x1x3 is the K=3 chain drafted as a tree).")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Prompt tokens (from held-out files).")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Generated tokens per prompt.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "Prompts per configuration.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats (median reported).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0 = greedy.")
_OUT_DIR = flags.DEFINE_string("out_dir", os.path.join(REPO, "benchmarks", "results"),
                               "Where the JSON and Markdown results go.")


def _prompts(loaded, n, length):
  from maverick import data
  tok = loaded.tokenizer
  val = data.load_split(None, "validation")
  docs = data.encode_documents(tok.hf_tokenizer, val.texts, tok.bos_id)
  prompts = [d[:length].tolist() for d in docs if len(d) > length]
  if len(prompts) < n:
    raise ValueError(f"only {len(prompts)} held-out files have more than {length} tokens")
  return prompts[:n]


def _run(fn, groups):
  """Generated tokens, seconds, and the per-group outputs of one pass over all prompt groups."""
  outs, start = [], time.perf_counter()
  for g in groups:
    outs.append(fn(g))
  return sum(int(o.num_tokens.sum()) for o in outs), time.perf_counter() - start, outs


def _round_breakdown(loaded, draft, k, prompt, repeats):
  """Per-piece time of one speculative round at batch 1, each piece run n times inside ONE
  compiled loop (so Python dispatch is not counted, as inside the real generate loop)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from maverick import generation as plain
  from maverick import sampling
  from spec_decode.speculative import _features, draft_chain
  from spec_decode.verify import verify_chain
  target = loaded.model
  V = target.config.vocab_size
  req, _, capacity = plain.prepare(target.config, [prompt], max_new_tokens=_NEW.value)
  capacity += k + 1
  tg, ts = nnx.split(target)
  dg, ds = nnx.split(draft)
  aux = draft.config.aux_layer_ids
  n = 50
  params = sampling.SamplingParams.create(1)
  stop_ids = jnp.full((1, 1), -1, jnp.int32)
  # A history whose token index is i: the rows' random streams differ per iteration.
  history = lambda i: dataclasses.replace(sampling.empty_output(1, V),
                                          num_tokens=jnp.full((1,), i, jnp.int32))

  def setup(ts, ds, req):
    t, d = nnx.merge(tg, ts), nnx.merge(dg, ds)
    _, cache = plain.prefill(t, req, capacity, capture_layers=aux)
    out = t(jnp.zeros((1, k + 1), jnp.int32), cache=cache, capture_layers=aux)
    return cache, d.init_cache(1, capacity), out.hidden, out.logits

  cache, dcache, hidden, logits = jax.jit(setup)(ts, ds, req)

  def looped(piece):
    def run(ts, ds):
      def body(i, acc):
        return acc + piece(nnx.merge(tg, ts), nnx.merge(dg, ds), i)
      return jax.lax.fori_loop(0, n, body, jnp.zeros((), jnp.float32))
    f = jax.jit(run)
    jax.block_until_ready(f(ts, ds))
    times = []
    for _ in range(max(3, repeats)):
      t0 = time.perf_counter()
      jax.block_until_ready(f(ts, ds))
      times.append((time.perf_counter() - t0) / n)
    return 1e3 * statistics.median(times)

  L = req.prompt_lengths
  tokens = lambda i: (jnp.arange(k + 1, dtype=jnp.int32)[None] + i) % V

  def verify(t, d, i):
    out = t(tokens(i), cache=cache.with_lengths(L), capture_layers=aux)
    return _consume(out.logits, out.hidden, out.cache.k, out.cache.v)

  def drafting(t, d, i):
    dout = d(tokens(i), d.fuse(_features(hidden)), t.embed[...], cache=dcache.with_lengths(L),
             logits_at=jnp.zeros((1,), jnp.int32))
    cand, dc = draft_chain(d, dout.logits, dout.hidden, dout.cache, L + 1, t.embed[...], params,
                           history(i), stop_ids, k=k, vocab=V)
    return _consume(cand.tokens, cand.probs, dc.k, dc.v)

  def accept(t, d, i):
    cand_tokens = tokens(i)[:, 1:]
    from spec_decode.verify import Candidates, chain_parents
    q = jax.nn.one_hot(cand_tokens, V)
    nacc, nxt = verify_chain(logits, Candidates(cand_tokens, q, chain_parents(k)), params,
                             history(i), stop_ids)
    return _consume(nacc, nxt)

  def plain_step(t, d, i):
    out = t(tokens(i)[:, :1], cache=cache.with_lengths(L))
    return _consume(sampling.sample(out.logits[:, 0], params, history(i), stop_ids)[0], out.cache.k,
                    out.cache.v)

  def _consume(*outs):
    """Sums every output so XLA cannot drop work the real loop needs."""
    return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(outs))

  return {"verify_ms": looped(verify), "draft_ms": looped(drafting),
          "accept_ms": looped(accept), "plain_step_in_loop_ms": looped(plain_step)}


def _profiled_shares(loaded, draft, k, prompts):
  """Share of op time per piece of the round, from a profile of one real generate call: each
  compiled op is attributed through its named scope (spec_decode.speculative.SCOPES); "other" is
  the prefill and the loop's own control. Shares, not times: tracing adds a fixed cost per op, so
  absolute traced times overstate pieces made of many small ops."""
  import glob
  import tempfile
  import jax
  import spec_decode
  from maverick import profiling
  from spec_decode import speculative as spec
  run = lambda: spec_decode.generate(loaded.model, draft, prompts, k=k,
                                     max_new_tokens=_NEW.value, stop_tokens=[])
  run()
  scopes = profiling.op_scopes(spec.most_recent_executable().as_text())
  with tempfile.TemporaryDirectory() as log_dir:
    jax.profiler.start_trace(log_dir)
    run()
    jax.profiler.stop_trace()
    trace = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)[0]
    times = profiling.host_op_times(trace)
  by_piece = profiling.time_by_scope(times, scopes, dict(spec.SCOPES))
  total = sum(by_piece.values()) or 1
  return {piece: ns / total for piece, ns in by_piece.items()}


def main(argv):  # Ctrl-C stops it at once, mid-compile too (cli.run_interruptibly)
  return cli.run_interruptibly("spec_decode", _main, argv)


def _main(argv):
  cli.start(argv)
  import jax
  from tqdm import tqdm
  import maverick
  import spec_decode
  from maverick.generation import generate

  loaded = maverick.load(_TARGET.value)
  draft = spec_decode.load_draft(_DRAFT.value or _TARGET.value, loaded.model)
  batches = [int(b) for b in _BATCHES.value]
  ks = [int(k) for k in _KS.value]
  trees = [spec_decode.TreeShape.parse(t) for t in _TREES.value]
  prompts = _prompts(loaded, _NUM_PROMPTS.value, _PROMPT_LEN.value)
  kw = dict(max_new_tokens=_NEW.value, temperature=_TEMPERATURE.value, stop_tokens=[])
  device = jax.devices()[0].device_kind.replace(" ", "_").lower()
  rows = []
  bar = tqdm(total=len(batches) * (len(ks) + len(trees)), desc="configs")
  for B in batches:
    groups = [prompts[i:i + B] for i in range(0, len(prompts) - B + 1, B)]
    for k in ks + trees:
      if k == 0:
        fn = lambda g: generate(loaded.model, g, **kw)
      elif isinstance(k, spec_decode.TreeShape):
        fn = lambda g, t=k: spec_decode.generate(loaded.model, draft, g, tree=t, **kw)
      else:
        fn = lambda g, k=k: spec_decode.generate(loaded.model, draft, g, k=k, **kw)
      first = fn(groups[0])  # compiles
      times, tokens = [], 0
      for _ in range(_REPEATS.value):
        tokens, seconds, outs = _run(fn, groups)
        times.append(seconds)
      row = {"batch": B, "k": k if isinstance(k, int) else None,
             "tree": str(k) if isinstance(k, spec_decode.TreeShape) else None,
             "tokens": tokens, "seconds": statistics.median(times),
             "compile_seconds": first.compile_seconds}
      row["tokens_per_second"] = tokens / row["seconds"]
      row["tokens_per_second_per_user"] = row["tokens_per_second"] / B
      if k != 0:
        rounds = sum(int(o.rounds.sum()) for o in outs)
        row["acceptance_length"] = sum(int(o.accepted.sum()) for o in outs) / rounds
        row["per_position_acceptance"] = (
            sum(o.accepted_at.sum(0) for o in outs) / rounds).tolist()
        row["rounds"] = rounds
      rows.append(row)
      bar.update(1)
  bar.close()
  for r in rows:
    base = next(x for x in rows if x["batch"] == r["batch"] and x["k"] == 0)
    r["speedup_vs_k0"] = r["tokens_per_second"] / base["tokens_per_second"]

  breakdown = None
  if 3 in ks and 1 in batches:
    breakdown = _round_breakdown(loaded, draft, 3, prompts[0], _REPEATS.value)
    r3 = next(r for r in rows if r["batch"] == 1 and r["k"] == 3)
    breakdown["round_ms"] = 1e3 * r3["seconds"] / r3["rounds"]
    breakdown["rest_ms"] = (breakdown["round_ms"] - breakdown["verify_ms"] - breakdown["draft_ms"]
                            - breakdown["accept_ms"])
    r0 = next(r for r in rows if r["batch"] == 1 and r["k"] == 0)
    breakdown["plain_step_ms"] = 1e3 * r0["seconds"] / r0["tokens"]
    breakdown["profiled_shares"] = _profiled_shares(loaded, draft, 3, prompts[:1])

  result = {"device": device, "target": _TARGET.value, "draft": _DRAFT.value or _TARGET.value,
            "command": "python benchmarks/spec_decode.py " + " ".join(sys.argv[1:]),
            "prompts": len(prompts), "prompt_len": _PROMPT_LEN.value,
            "max_new_tokens": _NEW.value, "temperature": _TEMPERATURE.value,
            "repeats": _REPEATS.value, "rows": rows, "round_breakdown_k3_batch1": breakdown}
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  stem = os.path.join(_OUT_DIR.value, f"spec_decode_{device}")
  with open(stem + ".json", "w") as f:
    json.dump(result, f, indent=1)
  table = _markdown(result)
  with open(stem + ".md", "w") as f:
    f.write(table)
  print(table)
  return 0


def _markdown(res):
  lines = [f"Device: {res['device']} | target {res['target']} + EAGLE-3 draft | "
           f"{res['prompts']} held-out prompts x {res['max_new_tokens']} new tokens, "
           f"temperature {res['temperature']} | `{res['command'].strip()}`", "",
           "| batch | draft (K or tree DxKxN) | tokens/s | tokens/s/user | speed-up vs K=0 | "
           "acceptance length | per-position (per-level) acceptance | compile s |",
           "|---|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    al = f"{r['acceptance_length']:.2f}" if "acceptance_length" in r else "-"
    pp = " ".join(f"{x:.2f}" for x in r.get("per_position_acceptance", [])) or "-"
    shape = f"tree {r['tree']}" if r.get("tree") else r["k"]
    lines.append(f"| {r['batch']} | {shape} | {r['tokens_per_second']:.1f} | "
                 f"{r['tokens_per_second_per_user']:.1f} | {r['speedup_vs_k0']:.2f}x | {al} | "
                 f"{pp} | {r['compile_seconds']:.1f} |")
  b = res["round_breakdown_k3_batch1"]
  if b:
    lines += ["", f"Round at K=3, batch 1 (pieces timed alone inside a compiled loop): "
              f"{b['round_ms']:.2f} ms per round in generation = target verify of 4 tokens "
              f"{b['verify_ms']:.2f} ms + draft extend and chain {b['draft_ms']:.2f} ms + "
              f"acceptance {b['accept_ms']:.2f} ms + stopping/cache bookkeeping "
              f"{b['rest_ms']:.2f} ms. A plain decode step: {b['plain_step_ms']:.2f} ms in "
              f"generation ({b['plain_step_in_loop_ms']:.2f} ms alone)."]
    shares = b.get("profiled_shares")
    if shares:
      names = {"verify": "target verify", "draft_extend": "draft extend", "draft": "draft chain",
               "accept": "acceptance", "bookkeeping": "stopping/bookkeeping",
               "other": "prefill + loop control"}
      in_round = {p: v for p, v in shares.items() if p != "other"}
      total = sum(in_round.values()) or 1
      parts = ", ".join(f"{names.get(p, p)} {100 * v / total:.1f} % (~{v / total * b['round_ms']:.2f}"
                        f" ms)" for p, v in sorted(in_round.items(), key=lambda x: -x[1]))
      lines += ["", f"Profiled inside one generate call (each compiled op attributed by its named "
                f"scope; share of the round's op time, ms = share x the round): {parts}. Outside "
                f"the rounds (prefill, loop control): {100 * shares.get('other', 0):.1f} % of the "
                f"call's op time."]
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  app.run(main)
