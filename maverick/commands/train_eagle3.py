"""Trains an EAGLE-3 draft head for a target model with training-time test (TTT).

  python scripts/train_eagle3.py                  # draft for the embedded model -> maverick/assets/tiny_eagle3
  python scripts/train_eagle3.py --steps 20 --num_sequences 64 --out_dir /tmp/d --workdir /tmp/w  # smoke

Steps: (1) the frozen target generates continuations of random windows of the corpus's train split
(greedy and sampled, --gen_temperatures), cached in --workdir; (2) TTT training with optax AdamW and
orbax checkpoints (rerun to resume); (3) export the draft, then measure greedy acceptance length at K=3
on held-out corpus files and write a model card.

Run as `maverick-train-eagle3` (an installed maverick-jax's console script), as
`python -m maverick.commands.train_eagle3`, or from a source checkout as
`python scripts/train_eagle3.py`.
"""

import json
import os
import sys

from absl import flags

from maverick import cli

_TARGET = flags.DEFINE_string("target", "tiny", "Target model (see scripts/generate.py).")
_OUT_DIR = flags.DEFINE_string("out_dir", cli.default_path("maverick", "assets", "tiny_eagle3"),
                               "Where the trained draft and its model card go.")
_WORKDIR = flags.DEFINE_string("workdir", cli.default_path("runs", "train_eagle3"),
                               "Generated data and training checkpoints; rerun to resume.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Folder of .py files for prompts. Default: "
                                "this Python's standard library.")
_VAL_FRACTION = flags.DEFINE_float("val_fraction", 0.05, "Held-out fraction of files.")
_NUM_SEQ = flags.DEFINE_integer("num_sequences", 4096, "Target-generated training sequences.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "Corpus tokens per prompt.")
_GEN_LEN = flags.DEFINE_integer("gen_len", 192, "Target-generated tokens per sequence.")
_GEN_TEMPS = flags.DEFINE_list("gen_temperatures", ["0", "0.8"],
                               "Sampling temperatures for data generation (split evenly).")
_STEPS = flags.DEFINE_integer("steps", 600, "Optimizer steps.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Sequences per step.")
_LR = flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW learning rate.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 40, "Linear warmup steps.")
_TTT = flags.DEFINE_integer("ttt_length", 3, "Unrolled draft steps: step j trains the (j+1)-th "
                           "draft of a chain, so 3 covers K = 3 (the reference uses 7).")
_MLP_WIDTH = flags.DEFINE_integer("mlp_width", None, "Draft MLP width (default: the target's "
                                  "dense MLP width).")
_DRAFT_VOCAB = flags.DEFINE_integer("draft_vocab_size", None, "Reduced draft vocabulary (most "
                                    "frequent ids in the data, mapped by d2t). Default: full.")
_INIT = flags.DEFINE_string("init_draft", None, "Continue training from this draft (a directory "
                            "saved by this script, or 'tiny' for the shipped one) instead of a "
                            "random init; its config and vocabulary map are kept.")
_SEED = flags.DEFINE_integer("seed", 0, "Init, data and batch-order seed.")
_CKPT_EVERY = flags.DEFINE_integer("checkpoint_every", 50, "Checkpoint interval (steps).")
_EVAL_PROMPTS = flags.DEFINE_integer("eval_prompts", 32, "Held-out prompts for acceptance length.")
_EVAL_NEW = flags.DEFINE_integer("eval_new_tokens", 128, "Tokens generated per eval prompt.")
_EVAL_EVERY = flags.DEFINE_integer(
    "eval_every", 100, "Early stopping: every this many steps, measure greedy acceptance at K=3 "
    "on --stop_prompts held-out files (disjoint from the card's and the benchmark's); 0 = off.")
_PATIENCE = flags.DEFINE_integer("patience", 3, "Stop after this many evaluations without a new "
                                 "best acceptance; the best draft is the one exported.")
_STOP_PROMPTS = flags.DEFINE_integer("stop_prompts", 16, "Held-out prompts of the early-stopping "
                                     "evaluation (64 new tokens each).")



def main(argv):
  try:
    cli.start(argv)
  except cli.UsageError as e:
    return cli.fail("train_eagle3", e)
  import numpy as np
  from maverick import loading
  from maverick import data, train as train_lib
  from maverick.checkpoint import CheckpointError
  from spec_decode import checkpoint as draft_ckpt
  from spec_decode import speculative as spec
  from spec_decode import train as spec_train
  from spec_decode.draft import DraftConfigError, Eagle3Config

  try:
    temps = [float(t) for t in _GEN_TEMPS.value]
    if not temps or any(t < 0 for t in temps):
      raise ValueError(f"--gen_temperatures must be numbers >= 0, got {_GEN_TEMPS.value}")
    loaded = loading.load(_TARGET.value)
    target, tok = loaded.model, loaded.tokenizer
    if tok is None or not hasattr(tok, "hf_tokenizer"):
      raise ValueError(f"target {_TARGET.value} has no tokenizer.json to read the corpus with")
    root = _DATA_DIR.value or data.stdlib_root()
    train_texts = data.load_split(root, "train", _VAL_FRACTION.value)
    val_texts = data.load_split(root, "validation", _VAL_FRACTION.value)
    train_lib.check_writable(_WORKDIR.value)
    train_lib.check_writable(os.path.dirname(os.path.abspath(_OUT_DIR.value)))
    stream = data.token_stream(
        data.encode_documents(tok.hf_tokenizer, train_texts.texts, tok.bos_id),
        loaded.config.eos_token_ids[0] if loaded.config.eos_token_ids else tok.eos_ids[0])
    sequences = _training_sequences(np, spec_train, target, stream, temps)
    dcfg = Eagle3Config.for_target(loaded.config, intermediate_size=_MLP_WIDTH.value,
                                   draft_vocab_size=_DRAFT_VOCAB.value)
    d2t, init = None, None
    if _INIT.value:
      import spec_decode
      init = spec_decode.load_draft(_INIT.value, target)
      dcfg = init.config
    elif dcfg.draft_vocab_size < loaded.config.vocab_size:
      d2t = spec_train.vocab_map(sequences, loaded.config.vocab_size, dcfg.draft_vocab_size)
    tc = train_lib.TrainConfig(steps=_STEPS.value, batch_size=_BATCH.value,
                               seq_len=sequences.shape[1], learning_rate=_LR.value,
                               warmup_steps=_WARMUP.value, weight_decay=0.0, clip_norm=0.5,
                               seed=_SEED.value, checkpoint_every=_CKPT_EVERY.value)
    print(f"draft: {sum(x.size for x in _param_leaves(dcfg)) / 1e6:.2f} M parameters; "
          f"{tc.steps} steps x {tc.batch_size} sequences of {tc.seq_len} tokens; "
          f"TTT length {_TTT.value}")
    # Held-out files: the first prompt_len tokens of each validation file. The card reports the
    # first --eval_prompts (benchmarks/spec_decode.py uses the first 8 of them); early stopping
    # selects on the next --stop_prompts, so the reported acceptance is not the selection metric.
    docs = data.encode_documents(tok.hf_tokenizer, val_texts.texts, tok.bos_id)
    held_out = [d[:_PROMPT_LEN.value].tolist() for d in docs if len(d) >= _PROMPT_LEN.value]
    prompts = held_out[:_EVAL_PROMPTS.value]
    stop_prompts = held_out[_EVAL_PROMPTS.value:_EVAL_PROMPTS.value + _STOP_PROMPTS.value]
    if _EVAL_EVERY.value and not stop_prompts:
      raise ValueError(f"no held-out files left for early stopping after the {len(prompts)} "
                       "evaluation prompts; lower --eval_prompts or pass --eval_every 0")
    stopper = _EarlyStopping(spec, target, stop_prompts, loaded.stop_tokens, loaded.config.dtype,
                             _PATIENCE.value)
    result = spec_train.train_draft(target, dcfg, tc, sequences, _WORKDIR.value,
                                    ttt=spec_train.TTTConfig(length=_TTT.value), d2t=d2t,
                                    evaluate=stopper if _EVAL_EVERY.value else None,
                                    eval_every=_EVAL_EVERY.value, init=init)
  except (data.CorpusError, train_lib.TrainError, CheckpointError, DraftConfigError, ValueError,
          OSError) as e:
    return cli.fail("train_eagle3", e)

  draft = _cast(result.draft, loaded.config.dtype)
  if stopper.best is not None and stopper.best_step != result.step:
    if stopper.evaluate(draft) <= stopper.best_acceptance:  # the final draft is not better
      draft = stopper.best
  out = draft_ckpt.save_draft(draft, _OUT_DIR.value, overwrite=True)
  gen = spec.generate(target, draft, prompts, k=3, max_new_tokens=_EVAL_NEW.value,
                      stop_tokens=loaded.stop_tokens)
  final = result.history[-1] if result.history else {}
  card = {
      "command": "python scripts/train_eagle3.py " + " ".join(sys.argv[1:]),
      "target": _TARGET.value, "config": draft.config.to_dict(),
      "train": {"steps": result.step, "batch_size": tc.batch_size, "seq_len": tc.seq_len,
                "sequences": int(len(sequences)), "gen_temperatures": temps,
                "prompt_len": _PROMPT_LEN.value, "gen_len": _GEN_LEN.value,
                "ttt_length": _TTT.value, "learning_rate": tc.learning_rate,
                "seconds_this_run": round(result.seconds, 1),
                "early_stopping": {"every": _EVAL_EVERY.value, "patience": _PATIENCE.value,
                                   "prompts": len(stop_prompts), "best_step": stopper.best_step,
                                   "curve": stopper.curve},
                "resumed_from_step": result.resumed_from,
                "final": {k: v for k, v in final.items() if k.startswith(("loss", "acc", "step"))}},
      "eval": {"prompts": len(prompts), "new_tokens": _EVAL_NEW.value, "k": 3,
               "greedy_acceptance_length": gen.acceptance_length,
               "per_position_acceptance": gen.acceptance_rates.tolist(),
               "files": "first prompt_len tokens of validation files"},
  }
  cli.write_atomic(os.path.join(out, "model_card.json"), json.dumps(card, indent=1))
  cli.write_atomic(os.path.join(out, "MODEL_CARD.md"), _markdown(card))
  print(f"exported {out}; greedy acceptance length at K=3 on {len(prompts)} held-out prompts: "
        f"{gen.acceptance_length:.3f} (per position {np.round(gen.acceptance_rates, 3).tolist()})")
  return 0


class _EarlyStopping:
  """evaluate(step, draft) -> stop: held-out greedy acceptance at K=3; keeps the best draft."""

  def __init__(self, spec, target, prompts, stop_tokens, dtype, patience):
    self.spec, self.target, self.prompts = spec, target, prompts
    self.stop_tokens, self.dtype, self.patience = stop_tokens, dtype, patience
    self.best, self.best_step, self.best_acceptance = None, None, -1.0
    self.curve: list[tuple[int, float]] = []

  def evaluate(self, draft) -> float:
    gen = self.spec.generate(self.target, draft, self.prompts, k=3, max_new_tokens=64,
                             stop_tokens=self.stop_tokens)
    return gen.acceptance_length

  def __call__(self, step, draft) -> bool:
    draft = _cast(draft, self.dtype)
    acceptance = self.evaluate(draft)
    self.curve.append((step, round(acceptance, 4)))
    if acceptance > self.best_acceptance:
      self.best, self.best_step, self.best_acceptance = draft, step, acceptance
    since_best = sum(1 for s, _ in self.curve if s > self.best_step)
    print(f"\nstep {step}: held-out acceptance {acceptance:.3f} (best {self.best_acceptance:.3f} "
          f"at step {self.best_step})", flush=True)
    return since_best >= self.patience


def _training_sequences(np, spec_train, target, stream, temps):
  """Generated once and cached in the workdir, so a resumed run trains on the same data."""
  path = os.path.join(_WORKDIR.value, "sequences.npy")
  meta_path = os.path.join(_WORKDIR.value, "sequences.json")
  meta = {"num": _NUM_SEQ.value, "prompt_len": _PROMPT_LEN.value, "gen_len": _GEN_LEN.value,
          "temperatures": temps, "seed": _SEED.value, "target": _TARGET.value}
  if os.path.isfile(path) and os.path.isfile(meta_path):
    with open(meta_path) as f:
      if json.load(f) == meta:
        return np.load(path, allow_pickle=False)
  per = -(-_NUM_SEQ.value // len(temps))
  parts = [spec_train.generate_sequences(target, stream, num=per, prompt_len=_PROMPT_LEN.value,
                                         gen_len=_GEN_LEN.value, temperature=t,
                                         seed=_SEED.value + 1000 * i)
           for i, t in enumerate(temps)]
  seqs = np.concatenate(parts)[:_NUM_SEQ.value]
  tmp = f"{path}.tmp-{os.getpid()}.npy"
  np.save(tmp, seqs, allow_pickle=False)
  os.replace(tmp, path)
  cli.write_atomic(meta_path, json.dumps(meta))
  return seqs


def _param_leaves(dcfg):
  import jax
  from flax import nnx
  from spec_decode.draft import abstract_draft
  return jax.tree.leaves(nnx.split(abstract_draft(dcfg), nnx.Param, ...)[1])


def _cast(draft, dtype):
  """Float weights to the target's dtype; the d2t map stays int32."""
  import dataclasses
  import jax
  from flax import nnx
  from spec_decode.draft import Buffer
  graphdef, params, buffers = nnx.split(draft, nnx.Param, Buffer)
  new = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(dtype), params), buffers)
  new.config = dataclasses.replace(new.config, layer=new.config.layer.replace(dtype=dtype))
  return new



def _markdown(card):
  c, t, e = card["config"], card["train"], card["eval"]
  lc = c["layer"]
  rates = ", ".join(f"{r:.2f}" for r in e["per_position_acceptance"])
  return f"""# EAGLE-3 draft for the embedded model (`spec_decode.load_draft("tiny")`)

One Llama decoder layer (q/k/v over [embedding; hidden], width {lc['hidden_size']}, {lc['num_attention_heads']} heads /
{lc['num_key_value_heads']} kv heads, MLP {lc['intermediate_size_mlp']}) fusing the target's layer outputs {c['aux_layer_ids']},
draft vocabulary {c['draft_vocab_size']} of {c['target_vocab_size']}; the target's embedding is shared.

## Training
- Command: `{card['command']}`
- Data: {t['sequences']} target-generated sequences ({t['prompt_len']} corpus tokens + {t['gen_len']} generated,
  temperatures {t['gen_temperatures']}) from the stdlib train split.
- Training-time test, {t['ttt_length']} unrolled steps, loss weights 0.8^j; {t['steps']} steps x {t['batch_size']} sequences;
  AdamW lr {t['learning_rate']}; last run {t['seconds_this_run'] / 60:.1f} min on 2 CPU cores.
- Early stopping on held-out acceptance (K=3, {t['early_stopping']['prompts']} files disjoint from the ones below), every
  {t['early_stopping']['every']} steps, patience {t['early_stopping']['patience']}: exported step {t['early_stopping']['best_step']}; curve (step, acceptance)
  {t['early_stopping']['curve']}.
- Final metrics: {json.dumps(t['final'])}

## Acceptance (held-out stdlib files, greedy, K = {e['k']})
- **{e['greedy_acceptance_length']:.3f} tokens per verify step** over {e['prompts']} prompts x {e['new_tokens']} new tokens.
- Per-position acceptance: {rates}.
- `benchmarks/spec_decode.py` measures the speed-up.
"""


console_main = cli.console_main(main, __name__)  # the console script `maverick-train-eagle3`

if __name__ == "__main__":
  console_main()
