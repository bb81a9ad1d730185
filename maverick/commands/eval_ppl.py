"""Perplexity and bits per byte of a checkpoint on a folder of text files (batched, jitted).

  python scripts/eval_ppl.py                                   # embedded model, stdlib validation split
  python scripts/eval_ppl.py --checkpoint /ckpt/scout --data_dir ~/code --split all --suffix .py

Documents are cut into non-overlapping windows of --seq_len tokens (maverick/evaluation.py); bits per
byte divides the total negative log-likelihood by the UTF-8 bytes of the text, so tokenizers compare.

Run as `maverick-eval-ppl` (an installed maverick-jax's console script), as
`python -m maverick.commands.eval_ppl`, or from a source checkout as
`python scripts/eval_ppl.py`.
"""


from absl import flags

from maverick import cli

_CHECKPOINT = flags.DEFINE_string("checkpoint", "tiny", "Model to evaluate (see generate.py).")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Folder of text files. Default: this Python's "
                                "standard library.")
_SPLIT = flags.DEFINE_enum("split", "validation", ["validation", "train", "all"],
                           "File split (held-out files by path hash, as in training).")
_VAL_FRACTION = flags.DEFINE_float("val_fraction", 0.05, "Held-out fraction used by the split.")
_SUFFIX = flags.DEFINE_string("suffix", ".py", "File name suffix to read.")
_MAX_FILES = flags.DEFINE_integer("max_files", None, "Evaluate only the first N files.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 512, "Window length in tokens.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Windows per device call.")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                           "Compute dtype. Default: the checkpoint's.")
_KV_CACHE = cli.define_kv_cache_flag()
_BASELINE = flags.DEFINE_bool("unigram_baseline", True, "Also report a unigram byte model fit on "
                              "the train split of the same folder.")



def main(argv):  # Ctrl-C stops it at once, mid-compile too (cli.run_interruptibly)
  return cli.run_interruptibly("eval_ppl", _main, argv)


def _main(argv):
  try:
    cli.start(argv)
  except cli.UsageError as e:
    return cli.fail("eval_ppl", e)
  from maverick import loading
  from maverick import data, evaluation
  from maverick.checkpoint import CheckpointError
  from maverick.config import ConfigError

  try:
    root = _DATA_DIR.value or data.stdlib_root()
    files = data.split_files(root, _SPLIT.value, _VAL_FRACTION.value, _SUFFIX.value)
    if _MAX_FILES.value:
      files = files[:_MAX_FILES.value]
    if not files:
      raise data.CorpusError(f"no {_SUFFIX.value} files in the {_SPLIT.value!r} split of {root}")
    texts = data.read_texts(root, files)
    loaded = loading.load(_CHECKPOINT.value, dtype=_DTYPE.value, kv_cache=_KV_CACHE.value)
    if loaded.tokenizer is None or not hasattr(loaded.tokenizer, "hf_tokenizer"):
      raise ValueError(f"{_CHECKPOINT.value} has no tokenizer.json to tokenize text with")
    if _SEQ_LEN.value < 1 or _BATCH.value < 1:
      raise ValueError("--seq_len and --batch_size must be >= 1")
    result = evaluation.evaluate(loaded.model, loaded.tokenizer, texts.texts,
                                 seq_len=_SEQ_LEN.value, batch_size=_BATCH.value, progress=True)
  except (data.CorpusError, CheckpointError, ConfigError, ValueError, FileNotFoundError) as e:
    return cli.fail("eval_ppl", e)
  print(f"{loaded.source} on {root} [{_SPLIT.value}]: {result.files} files, {result.bytes} bytes, "
        f"{result.tokens} tokens ({len(texts.skipped)} skipped, not UTF-8)")
  print(f"bits/byte {result.bits_per_byte:.4f} | nats/token {result.nats_per_token:.4f} | "
        f"perplexity {result.perplexity:.3f}")
  if _BASELINE.value and _SPLIT.value != "train":
    train_texts = data.load_split(root, "train", _VAL_FRACTION.value, _SUFFIX.value).texts
    base = evaluation.unigram_byte_bits_per_byte(train_texts, texts.texts)
    print(f"unigram byte model: {base:.4f} bits/byte (model / unigram = "
          f"{result.bits_per_byte / base:.3f})")
  return 0


console_main = cli.console_main(main, __name__)  # the console script `maverick-eval-ppl`

if __name__ == "__main__":
  console_main()
