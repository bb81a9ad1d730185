"""BF16 vs FP8 of the same weights on a folder of text: does FP8 keep BF16 accuracy?

  python scripts/eval_fp8.py                      # embedded model + draft, stdlib held-out split
  python scripts/eval_fp8.py --recipe all_linears --kv_cache fp8
  python scripts/eval_fp8.py --checkpoint /ckpt/scout --fp8_checkpoint /ckpt/scout-fp8 --draft none

Reports, FP8 against BF16 (the reference):
  * teacher-forced top-1 agreement and mean KL(p_bf16 || p_fp8) per token, perplexity of both;
  * greedy generation agreement (position-wise and common-prefix) on prompts cut from the texts;
  * with a draft: EAGLE-3 acceptance length with the BF16 target and with the FP8 target.
The FP8 model is --fp8_checkpoint, or --checkpoint quantized in memory with --recipe. Its
teacher-forced pass attends through its own (FP8) KV cache, so KV quantization is measured too.

Run as `maverick-eval-fp8` (an installed maverick-jax's console script), as
`python -m maverick.commands.eval_fp8`, or from a source checkout as
`python scripts/eval_fp8.py`.
"""

import json

from absl import flags

from maverick import cli

# Weights kept in BF16 per recipe. "maverick": what the official Llama-4-Maverick FP8 checkpoint
# quantizes (routed experts only, spec §9); "all_linears": every linear but the router.
RECIPES = {"maverick": ("embed", "lm_head", "router", "attn", "mlp", "shared"),
           "all_linears": ("embed", "lm_head", "router")}

_CHECKPOINT = flags.DEFINE_string("checkpoint", "tiny", "BF16 model (see generate.py).")
_FP8_CHECKPOINT = flags.DEFINE_string(
    "fp8_checkpoint", None, "FP8 model (scripts/quantize.py output or an FP8 HF checkpoint). "
    "Default: --checkpoint quantized in memory with --recipe/--activations/--kv_cache.")
_RECIPE = flags.DEFINE_enum("recipe", "maverick", sorted(RECIPES),
                            "Which weights become FP8: 'maverick' = routed experts only (the "
                            "official FP8 checkpoint), 'all_linears' = every linear but the router.")
_ACTIVATIONS = flags.DEFINE_enum("activations", "dynamic_per_token", ["dynamic_per_token", "none"],
                                 "Activation quantization of the in-memory FP8 model.")
_KV_CACHE = flags.DEFINE_enum("kv_cache", "bf16", ["bf16", "fp8"], "KV cache of the in-memory "
                               "FP8 model (bf16: unquantized, in the model dtype; fp8: e4m3 with "
                               "a scale per token and kv head).")
_DRAFT = flags.DEFINE_string("draft", "tiny", "EAGLE-3 draft for the acceptance-length check "
                             "('tiny' = the embedded draft; 'none' to skip).")
_SPEC_K = flags.DEFINE_integer("spec_k", 3, "Draft tokens per speculative round.")
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Folder of text files (default: the stdlib).")
_SPLIT = flags.DEFINE_enum("split", "validation", ["validation", "train", "all"], "File split.")
_SUFFIX = flags.DEFINE_string("suffix", ".py", "File name suffix to read.")
_MAX_FILES = flags.DEFINE_integer("max_files", None, "Use only the first N files.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Teacher-forced window length in tokens.")
_MAX_WINDOWS = flags.DEFINE_integer("max_windows", 512, "Evaluate at most this many windows.")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Windows per device call.")
_PROMPTS = flags.DEFINE_integer("prompts", 32, "Prompts for greedy and speculative generation.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32, "Prompt length in tokens.")
_GEN_TOKENS = flags.DEFINE_integer("gen_tokens", 64, "Tokens generated per prompt.")
_OUT_JSON = flags.DEFINE_string("out_json", None, "Also write the results to this JSON file.")


def main(argv):  # Ctrl-C stops it at once, mid-compile too (cli.run_interruptibly)
  return cli.run_interruptibly("eval_fp8", _main, argv)


def _main(argv):
  try:
    cli.start(argv)
  except cli.UsageError as e:
    return cli.fail("eval_fp8", e)
  from maverick import loading
  from maverick import data, evaluation, quant
  from maverick.checkpoint import CheckpointError
  from maverick.config import ConfigError
  from maverick.quant import parity

  try:
    for name, v in (("seq_len", _SEQ_LEN), ("batch_size", _BATCH), ("prompts", _PROMPTS),
                    ("prompt_len", _PROMPT_LEN), ("gen_tokens", _GEN_TOKENS),
                    ("max_windows", _MAX_WINDOWS)):
      if v.value < 1:
        raise ValueError(f"--{name} must be >= 1, got {v.value}")
    root = _DATA_DIR.value or data.stdlib_root()
    files = data.split_files(root, _SPLIT.value, 0.05, _SUFFIX.value)[:_MAX_FILES.value]
    if not files:
      raise data.CorpusError(f"no {_SUFFIX.value} files in the {_SPLIT.value!r} split of {root}")
    texts = data.read_texts(root, files)
    ref = loading.load(_CHECKPOINT.value)
    if ref.config.quant is not None and ref.config.quant.weights is not None:
      raise ValueError(f"--checkpoint {_CHECKPOINT.value} is already FP8; pass the BF16 model")
    if _FP8_CHECKPOINT.value:
      test_model = loading.load(_FP8_CHECKPOINT.value).model
      recipe = f"checkpoint {_FP8_CHECKPOINT.value}"
    else:
      qc = quant.QuantConfig(activations=_ACTIVATIONS.value, skip=RECIPES[_RECIPE.value],
                             kv_cache=_KV_CACHE.value)
      test_model = quant.quantize_model(ref.model, qc)
      recipe = _RECIPE.value
    if ref.tokenizer is None or not hasattr(ref.tokenizer, "hf_tokenizer"):
      raise ValueError(f"{_CHECKPOINT.value} has no tokenizer.json to tokenize text with")
  except (data.CorpusError, CheckpointError, ConfigError, quant.QuantError, ValueError,
          FileNotFoundError) as e:
    return cli.fail("eval_fp8", e)

  qc = test_model.config.quant
  print(f"BF16: {ref.source}\nFP8 ({recipe}): {qc.to_dict() if qc else None}")
  docs = data.encode_documents(ref.tokenizer.hf_tokenizer, texts.texts, ref.tokenizer.bos_id)
  inputs, targets = evaluation.windows(docs, _SEQ_LEN.value)
  inputs, targets = inputs[:_MAX_WINDOWS.value], targets[:_MAX_WINDOWS.value]
  tf = parity.teacher_forced(ref.model, test_model, inputs, targets, batch_size=_BATCH.value,
                             progress=True)
  print(f"teacher-forced on {root} [{_SPLIT.value}] ({len(texts.files)} files, {len(inputs)} "
        f"windows of {_SEQ_LEN.value}, {tf.tokens} tokens):")
  print(f"  top-1 agreement {tf.top1_agreement:.2%} | mean KL(bf16||fp8) {tf.mean_kl:.5f} nats | "
        f"perplexity bf16 {tf.ppl_bf16:.3f} fp8 {tf.ppl_fp8:.3f} ({tf.ppl_increase:+.2%})")
  results = {"bf16": ref.source, "fp8": recipe, "quant": qc.to_dict() if qc else None,
             "data": {"root": root, "split": _SPLIT.value, "files": len(texts.files),
                      "windows": len(inputs), "seq_len": _SEQ_LEN.value},
             "teacher_forced": dict(vars(tf), ppl_increase=tf.ppl_increase)}

  prompts = parity.prompts_from(docs, _PROMPTS.value, _PROMPT_LEN.value)
  if prompts:
    g_ref = parity.generate_greedy(ref.model, prompts, _GEN_TOKENS.value)
    g_test = parity.generate_greedy(test_model, prompts, _GEN_TOKENS.value)
    ga = parity.greedy_agreement(g_ref.tokens, g_test.tokens)
    print(f"greedy generation ({ga.prompts} prompts x {_GEN_TOKENS.value} tokens): token agreement "
          f"{ga.token_agreement:.2%} | common prefix {ga.prefix_agreement:.2%} | identical "
          f"{ga.exact}/{ga.prompts}")
    results["greedy"] = vars(ga)
    if _DRAFT.value != "none":
      import spec_decode
      draft = spec_decode.load_draft(_DRAFT.value, ref.model)
      kw = dict(k=_SPEC_K.value, max_new_tokens=_GEN_TOKENS.value, stop_tokens=[])
      s_ref = spec_decode.generate(ref.model, draft, prompts, **kw)
      s_test = spec_decode.generate(test_model, draft, prompts, **kw)
      ratio = s_test.acceptance_length / s_ref.acceptance_length
      lossless = s_test.tokens == g_test.tokens
      print(f"speculative K={_SPEC_K.value}: acceptance length bf16 target "
            f"{s_ref.acceptance_length:.3f}, fp8 target {s_test.acceptance_length:.3f} "
            f"({ratio:.2%} of bf16); fp8 speculative output == fp8 greedy: {lossless}")
      results["speculative"] = {"k": _SPEC_K.value, "acceptance_bf16": s_ref.acceptance_length,
                                "acceptance_fp8": s_test.acceptance_length, "ratio": ratio,
                                "fp8_lossless": lossless}
  if _OUT_JSON.value:
    cli.write_atomic(_OUT_JSON.value, json.dumps(results, indent=1) + "\n")
  return 0


console_main = cli.console_main(main, __name__)  # the console script `maverick-eval-fp8`

if __name__ == "__main__":
  console_main()
