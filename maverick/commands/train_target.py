"""Trains the embedded default model: a small Llama 4 (every feature on) on the Python stdlib.

  python scripts/train_target.py                       # full run (~1 h on 2 CPU cores), then export
  python scripts/train_target.py --steps 20 --out_dir /tmp/m --workdir /tmp/w   # smoke run

Steps: (1) list the stdlib .py files and split them by file into train / validation (deterministic,
see maverick/data.py); (2) train a byte-level BPE tokenizer on the train split; (3) train the model
with optax AdamW, orbax checkpoints every --checkpoint_every steps in --workdir (rerun the same command
to resume after an interruption); (4) export bf16 weights + tokenizer + model card to --out_dir and
report validation bits per byte against a unigram byte model.

Run as `maverick-train-target` (an installed maverick-jax's console script), as
`python -m maverick.commands.train_target`, or from a source checkout as
`python scripts/train_target.py`.
"""

import hashlib
import json
import os
import platform
import sys
import time

from absl import flags

from maverick import cli

_OUT_DIR = flags.DEFINE_string("out_dir", cli.default_path("maverick", "assets", "tiny"),
                               "Where the exported model (weights, tokenizer, model card) goes.")
_WORKDIR = flags.DEFINE_string("workdir", cli.default_path("runs", "train_target"),
                               "Training checkpoints and the tokenizer; rerun to resume.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Folder of .py files. Default: this Python's "
                                "standard library.")
_VAL_FRACTION = flags.DEFINE_float("val_fraction", 0.05, "Fraction of files held out.")
_VOCAB = flags.DEFINE_integer("vocab_size", 4096, "BPE vocabulary incl. special tokens.")
_HIDDEN = flags.DEFINE_integer("hidden_size", 256, "Model width.")
_LAYERS = flags.DEFINE_integer("num_layers", 8, "Decoder layers.")
_HEADS = flags.DEFINE_integer("num_heads", 4, "Query heads.")
_KV_HEADS = flags.DEFINE_integer("num_kv_heads", 2, "Key/value heads.")
_EXPERTS = flags.DEFINE_integer("num_experts", 8, "Routed experts per MoE layer (top-1).")
_EXPERT_WIDTH = flags.DEFINE_integer("expert_width", 128, "Width of each expert and the shared one.")
_MLP_WIDTH = flags.DEFINE_integer("mlp_width", 384, "Width of the dense MLP layers.")
_CHUNK = flags.DEFINE_integer("chunk_size", 128, "Chunked-attention chunk on RoPE layers.")
_FLOOR_SCALE = flags.DEFINE_integer("floor_scale", 128, "NoPE temperature tuning floor scale.")
_STEPS = flags.DEFINE_integer("steps", 1000, "Optimizer steps.")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Sequences per step.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 512, "Tokens per sequence (the model's context).")
_LR = flags.DEFINE_float("learning_rate", 3e-3, "Peak AdamW learning rate.")
_WARMUP = flags.DEFINE_integer("warmup_steps", 50, "Linear warmup steps.")
_SEED = flags.DEFINE_integer("seed", 0, "Init and data-order seed.")
_CKPT_EVERY = flags.DEFINE_integer("checkpoint_every", 50, "Checkpoint interval (steps).")
_EXPORT_DTYPE = flags.DEFINE_enum("export_dtype", "bfloat16", ["bfloat16", "float32"],
                                  "Dtype of the exported weights.")



def main(argv):
  try:
    cli.start(argv)
  except cli.UsageError as e:
    return cli.fail("train_target", e)
  from maverick import data, evaluation, tokenizer as tok_lib, train
  from maverick.checkpoint import store
  from maverick.config import Config
  from maverick.model import num_params

  try:
    root = _DATA_DIR.value or data.stdlib_root()
    train_texts = data.load_split(root, "train", _VAL_FRACTION.value)
    val_texts = data.load_split(root, "validation", _VAL_FRACTION.value)
    skipped = len(train_texts.skipped) + len(val_texts.skipped)
    print(f"corpus {root}: {len(train_texts.files)} train files ({train_texts.num_bytes / 1e6:.1f} "
          f"MB), {len(val_texts.files)} validation files ({val_texts.num_bytes / 1e6:.2f} MB), "
          f"{skipped} skipped (not UTF-8)")
    train.check_writable(_WORKDIR.value)
    train.check_writable(os.path.dirname(os.path.abspath(_OUT_DIR.value)))
    tok_dir = os.path.join(_WORKDIR.value, "tokenizer")
    if os.path.isfile(os.path.join(tok_dir, tok_lib.TOKENIZER_FILE)):
      tok = tok_lib.Tokenizer.from_dir(tok_dir)
    else:
      tok = tok_lib.train_bpe(train_texts.texts, _VOCAB.value, tok_dir)
    end_of_text = tok.token_to_id(tok_lib.END_OF_TEXT_TOKEN)
    docs = data.encode_documents(tok.hf_tokenizer, train_texts.texts, tok.bos_id)
    stream = data.token_stream(docs, end_of_text)
    print(f"tokenizer: {tok.vocab_size} ids, {train_texts.num_bytes / len(stream):.2f} bytes/token;"
          f" train stream {len(stream) / 1e6:.2f} M tokens")

    cfg = Config(
        vocab_size=tok.vocab_size, hidden_size=_HIDDEN.value,
        intermediate_size=_EXPERT_WIDTH.value, intermediate_size_mlp=_MLP_WIDTH.value,
        num_hidden_layers=_LAYERS.value, num_attention_heads=_HEADS.value,
        num_key_value_heads=_KV_HEADS.value, head_dim=_HIDDEN.value // _HEADS.value,
        num_local_experts=_EXPERTS.value, num_experts_per_tok=1, interleave_moe_layer_step=2,
        tie_word_embeddings=True, use_qk_norm=True, rope_theta=10000.0,
        attention_chunk_size=_CHUNK.value, no_rope_layer_interval=4, attn_temperature_tuning=True,
        floor_scale=float(_FLOOR_SCALE.value), attn_scale=0.1,
        max_position_embeddings=_SEQ_LEN.value, bos_token_id=tok.bos_id,
        eos_token_ids=(end_of_text,), pad_token_id=tok.pad_id, dtype="float32")
    tc = train.TrainConfig(steps=_STEPS.value, batch_size=_BATCH.value, seq_len=_SEQ_LEN.value,
                           learning_rate=_LR.value, warmup_steps=_WARMUP.value, seed=_SEED.value,
                           checkpoint_every=_CKPT_EVERY.value)
    print(f"model: {num_params(cfg) / 1e6:.2f} M parameters; {tc.steps} steps x "
          f"{tc.batch_size} x {tc.seq_len} tokens")
    result = train.train(cfg, tc, stream, _WORKDIR.value)
  except (data.CorpusError, train.TrainError, ValueError, OSError) as e:
    return cli.fail("train_target", e)

  progress = _accumulate_progress(result)

  # Export: weights in the export dtype, the tokenizer next to them, then the model card.
  export_cfg = cfg.replace(dtype=_EXPORT_DTYPE.value)
  model = _cast(result.model, export_cfg)
  out = store.save_orbax(model, _OUT_DIR.value, overwrite=True, extra_files=[
      os.path.join(tok_dir, f) for f in ("tokenizer.json", "tokenizer_config.json")])
  print(f"exported to {out} ({_dir_bytes(out) / 1e6:.2f} MB)")

  t0 = time.perf_counter()
  val = evaluation.evaluate(model, tok, val_texts.texts, seq_len=tc.seq_len, batch_size=8,
                            progress=True)
  unigram = evaluation.unigram_byte_bits_per_byte(train_texts.texts, val_texts.texts)
  # A few small held-out files, re-evaluated by tests/test_embedded_model.py.
  subset = [i for i, t in enumerate(val_texts.texts) if 2_000 <= len(t.encode()) <= 16_000][:6]
  sub_texts = [val_texts.texts[i] for i in subset]
  sub = evaluation.evaluate(model, tok, sub_texts, seq_len=tc.seq_len, batch_size=8)
  final = progress["last_log"]
  card = {
      "command": "python scripts/train_target.py " + " ".join(sys.argv[1:]),
      "config": export_cfg.to_dict(), "train": {
          "steps": result.step, "batch_size": tc.batch_size, "seq_len": tc.seq_len,
          "tokens_seen": result.step * tc.batch_size * tc.seq_len,
          "learning_rate": tc.learning_rate, "warmup_steps": tc.warmup_steps,
          "train_seconds_all_runs": round(progress["train_seconds"], 1),
          "seconds_this_run": round(result.seconds, 1), "resumed_from_step": result.resumed_from,
          "final_train_loss_nats_per_token": final.get("ce"),
          "final_train_loss_step": final.get("step")},
      "data": {"root": root, "python": platform.python_version(), "val_fraction":
               _VAL_FRACTION.value, "train_files": len(train_texts.files),
               "train_bytes": train_texts.num_bytes, "validation_files": val_texts.files,
               "validation_bytes": val_texts.num_bytes, "skipped_not_utf8": skipped},
      "validation": {"bits_per_byte": val.bits_per_byte, "nats_per_token": val.nats_per_token,
                     "perplexity": val.perplexity, "tokens": val.tokens,
                     "eval_dtype": _EXPORT_DTYPE.value, "seq_len": tc.seq_len,
                     "eval_seconds": round(time.perf_counter() - t0, 1)},
      "unigram_byte_baseline_bits_per_byte": unigram,
      "validation_subset": {
          "files": [val_texts.files[i] for i in subset],
          "sha256": [hashlib.sha256(t.encode()).hexdigest() for t in sub_texts],
          "bits_per_byte": sub.bits_per_byte, "bytes": sub.bytes, "tokens": sub.tokens,
          "unigram_byte_baseline_bits_per_byte": evaluation.unigram_byte_bits_per_byte(
              train_texts.texts, sub_texts)},
      "num_parameters": num_params(cfg),
  }
  cli.write_atomic(os.path.join(out, "model_card.json"), json.dumps(card, indent=1))
  cli.write_atomic(os.path.join(out, "MODEL_CARD.md"), _card_markdown(card))
  print(f"validation: {val.bits_per_byte:.3f} bits/byte ({val.perplexity:.2f} ppl/token) vs "
        f"unigram bytes {unigram:.3f} bits/byte")
  return 0


def _accumulate_progress(result):
  """Training time and the last logged metrics over all (resumed) runs, kept in the workdir."""
  path = os.path.join(_WORKDIR.value, "progress.json")
  progress = {"train_seconds": 0.0, "last_log": {}}
  if os.path.isfile(path):
    with open(path) as f:
      progress = json.load(f)
  progress["train_seconds"] += result.seconds
  if result.history:
    progress["last_log"] = result.history[-1]
  cli.write_atomic(path, json.dumps(progress))
  return progress


def _cast(model, cfg):
  """The trained model with weights and config in the export dtype."""
  import jax
  from flax import nnx
  graphdef, state = nnx.split(model)
  new = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(cfg.dtype), state))
  new.config = cfg
  return new


def _dir_bytes(path):
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)



def _card_markdown(card) -> str:
  c, t, d, v = card["config"], card["train"], card["data"], card["validation"]
  moe = ", ".join(map(str, c["moe_layers"]))
  nope = ", ".join(str(i) for i, r in enumerate(c["no_rope_layers"]) if not r)
  return f"""# Embedded default model (`maverick.load("tiny")`)

A small model of the Llama 4 architecture trained here from scratch on the Python standard library's own
`.py` files (Python {d['python']}), so the main job runs offline with a model whose predictions are real.

| | |
|---|---|
| parameters | {card['num_parameters'] / 1e6:.2f} M ({c['dtype']} weights) |
| layers / width / heads / kv heads / head dim | {c['num_hidden_layers']} / {c['hidden_size']} / {c['num_attention_heads']} / {c['num_key_value_heads']} / {c['head_dim']} |
| MoE layers | {moe}: {c['num_local_experts']} experts top-{c['num_experts_per_tok']} + shared expert, width {c['intermediate_size']} |
| dense MLP width | {c['intermediate_size_mlp']} |
| attention | chunked (chunk {c['attention_chunk_size']}) on RoPE layers with QK norm; NoPE layers {nope} global with temperature tuning (floor scale {c['floor_scale']:g}, attn scale {c['attn_scale']:g}) |
| vocabulary | {c['vocab_size']} (byte-level BPE trained on the train split), tied embeddings |
| context | {t['seq_len']} tokens |

## Training
- Command: `{card['command']}`
- Data: {d['train_files']} train files ({d['train_bytes'] / 1e6:.1f} MB); {len(d['validation_files'])} validation files
  ({d['validation_bytes'] / 1e6:.2f} MB) held out whole (SHA-256 of the relative path, fraction {d['val_fraction']}); {d['skipped_not_utf8']} non-UTF-8 files skipped.
- {t['steps']} steps x {t['batch_size']} x {t['seq_len']} tokens = {t['tokens_seen'] / 1e6:.1f} M tokens; AdamW, peak LR {t['learning_rate']}, {t['warmup_steps']} warmup steps, cosine decay; bf16 matmuls, f32 master weights.
- Final train loss {t['final_train_loss_nats_per_token']:.3f} nats/token (step {t['final_train_loss_step']}); training wall time {t['train_seconds_all_runs'] / 60:.1f} min on 2 CPU cores
  (plus ~1 min for the tokenizer and ~1 min for export and evaluation).

## Validation (held-out stdlib files)
- **{v['bits_per_byte']:.3f} bits per byte** ({v['nats_per_token']:.3f} nats/token, perplexity {v['perplexity']:.2f}) in {v['eval_dtype']},
  non-overlapping windows of {v['seq_len']} tokens; `scripts/eval_ppl.py` reproduces it.
- Unigram byte model (byte frequencies of the train split): {card['unigram_byte_baseline_bits_per_byte']:.3f} bits per byte.

The validation file list is in `model_card.json`, with a {len(card['validation_subset']['files'])}-file subset
({card['validation_subset']['bits_per_byte']:.3f} bits/byte vs unigram {card['validation_subset']['unigram_byte_baseline_bits_per_byte']:.3f}) that the tests re-evaluate.
Reproduce: `python scripts/eval_ppl.py` (full validation split).
"""


console_main = cli.console_main(main, __name__)  # the console script `maverick-train-target`

if __name__ == "__main__":
  console_main()
