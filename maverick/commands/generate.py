"""Generates text with a Llama 4 checkpoint: one jitted device call per batch of prompts.

Examples:
  python scripts/generate.py --prompt "def fibonacci(n):"
  python scripts/generate.py --checkpoint /ckpt/scout --prompt "Hello" --temperature 0.6 --top_p 0.9
  python scripts/generate.py --checkpoint /ckpt/scout --batch_file prompts.txt --max_new_tokens 128
  python scripts/generate.py --checkpoint meta-llama/Llama-4-Scout-17B-16E-Instruct --chat --stream \\
      --prompt "Write a haiku about JAX"        # a Hugging Face repo id (needs huggingface_hub)

Prints each continuation, then compile time and generation speed (tokens/s, compile excluded).
With --stream, prints tokens as they come, then the time to the first output and the overall speed.

Run as `maverick-generate` (an installed maverick-jax's console script), as
`python -m maverick.commands.generate`, or from a source checkout as
`python scripts/generate.py`.
"""


from absl import flags

from maverick import gpu_flags

gpu_flags.configure()  # before anything starts a jax backend (XLA reads XLA_FLAGS once)

from maverick import cli  # noqa: E402
from maverick import mesh_flags  # noqa: E402  (defines --mesh, --layout, multi-host flags)

DEFAULT_CHECKPOINT = "tiny"

_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", DEFAULT_CHECKPOINT,
    "'tiny' (the embedded model trained on the Python stdlib), a checkpoint converted by "
    "scripts/convert_hf.py, a Hugging Face Llama 4 directory (config.json + safetensors), a Hugging "
    "Face repo id such as meta-llama/Llama-4-Scout-17B-16E-Instruct (resolved through the HF cache, "
    "downloading if needed; needs huggingface_hub; HF_HUB_OFFLINE=1 for cache only), or "
    "random:<preset> (random weights, byte tokenizer: output is noise; presets: tiny, "
    "tiny_top2_tied).")
_PROMPT = flags.DEFINE_string("prompt", None, "Prompt text (this or --batch_file).")
_BATCH_FILE = flags.DEFINE_string(
    "batch_file", None, "Text file with one prompt per line (blank lines skipped); all prompts run "
    "as one batch.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt (>= 1).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1]; 1 = off.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens; 0 = off.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed for sampling (same seed, same output).")
_DTYPE = flags.DEFINE_enum("dtype", None, list(cli.DTYPE_CHOICES),
                           "Compute/parameter dtype. Default: the checkpoint's.")
_MAX_CACHE_LEN = flags.DEFINE_integer(
    "max_cache_len", None, "KV cache positions per row. Default: prompt and generation buckets.")
_SPEC_K = flags.DEFINE_integer(
    "spec_k", 3, "EAGLE-3 speculative decoding: draft tokens per round (0 = plain decoding). "
    "Lossless: greedy output is identical, sampled output has the same distribution.")
_DRAFT = flags.DEFINE_string(
    "draft", None, "EAGLE-3 draft head: a draft saved by scripts/train_eagle3.py, or an EAGLE-3 "
    "checkpoint directory (config.json + safetensors, e.g. nvidia/Llama-4-Maverick-17B-128E-Eagle3)."
    " Default: the embedded draft when --checkpoint is the embedded model, else none (plain "
    "decoding).")
_TREE_DEPTH = flags.DEFINE_integer(
    "tree_depth", None, "EAGLE-2 dynamic tree drafting instead of a chain (with --tree_topk and "
    "--tree_nodes): levels of draft tokens per round. Replaces --spec_k; e.g. --tree_depth 5 "
    "--tree_topk 8 --tree_nodes 32.")
_TREE_TOPK = flags.DEFINE_integer("tree_topk", None, "Tree drafting: children per expanded node.")
_TREE_NODES = flags.DEFINE_integer(
    "tree_nodes", None, "Tree drafting: draft tokens verified per round (>= --tree_depth).")
_CHAT = flags.DEFINE_bool("chat", False, "Wrap each prompt in the Llama 4 chat template (needs "
                          "the checkpoint's tokenizer.json with the header tokens).")
_IMAGE = flags.DEFINE_multi_string(
    "image", None, "An image file (PNG, JPEG, ...; needs Pillow) for a multimodal checkpoint, "
    "repeatable, with one --prompt: each <|image|> in the prompt marks where an image goes, in "
    "order (none: the images go before the text, as the chat template puts them). Loads the "
    "checkpoint's vision tower.")
_KERNELS = cli.define_kernels_flag()
_CHECK_FINITE = cli.define_check_finite_flag()
_KV_CACHE = cli.define_kv_cache_flag()
_STREAM = flags.DEFINE_bool(
    "stream", False, "Print tokens as they are produced (one --prompt only). Runs one device call "
    "per --stream_chunk tokens, each re-reading the text so far (no KV cache kept between calls): "
    "costs one prefill per chunk plus a compile per new power-of-two text length; see "
    "maverick/streaming.py.")
_STREAM_CHUNK = flags.DEFINE_integer(
    "stream_chunk", 16, "Tokens per device call with --stream (bigger: fewer calls and prefills, "
    "coarser output).")



def _read_prompts() -> list[str]:
  if (_PROMPT.value is None) == (_BATCH_FILE.value is None):
    raise ValueError("pass exactly one of --prompt or --batch_file")
  if _PROMPT.value is not None:
    return [_PROMPT.value]
  try:
    with open(_BATCH_FILE.value, encoding="utf-8") as f:
      prompts = [line.rstrip("\n") for line in f if line.strip()]
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"cannot read --batch_file {_BATCH_FILE.value}: {e}") from None
  if not prompts:
    raise ValueError(f"--batch_file {_BATCH_FILE.value} has no prompts (one per line)")
  return prompts


def _image_inputs(tok, text: str, paths, vision_cfg, chat: bool):
  """(prompt ids with the images' token layouts, preprocessed images) for one --prompt."""
  from maverick import vision
  images = [vision.preprocess_image(vision.decode_image(p), vision_cfg.preprocess())
            for p in paths]
  if vision.IMAGE_TOKEN not in text:
    text = vision.IMAGE_TOKEN * len(images) + text
  text = vision.expand_image_placeholders(text, [im.tile_grid for im in images],
                                          vision_cfg.preprocess())
  ids = tok.apply_chat_template([{"role": "user", "content": text}]) if chat else tok.encode(text)
  return ids, images


def _tree_shape():
  values = (_TREE_DEPTH.value, _TREE_TOPK.value, _TREE_NODES.value)
  if all(v is None for v in values):
    return None
  if any(v is None for v in values):
    raise ValueError("tree drafting needs all of --tree_depth, --tree_topk and --tree_nodes")
  from spec_decode import TreeShape
  return TreeShape(*values)


def main(argv):
  # Ctrl-C at any point, mid-compile too: one line, exit status 130.
  return cli.run_interruptibly("generate", _main, argv)


def _main(argv):
  try:
    cli.start(argv)
  except cli.UsageError as e:
    return cli.fail("generate", e)
  from maverick import loading  # late: --help and flag errors stay instant
  from maverick.checkpoint import CheckpointError
  from maverick.config import ConfigError
  from maverick import kernels as kernels_lib
  from maverick import sharding
  from maverick.generation import generate
  from maverick.tokenizer import TokenizerError
  import spec_decode
  from spec_decode.draft import DraftConfigError

  try:
    texts = _read_prompts()
    paths = _IMAGE.value or []
    if paths and _PROMPT.value is None:
      raise ValueError("--image goes with one --prompt (not --batch_file)")
    mesh = mesh_flags.mesh_from_flags()
    loaded = loading.load(_CHECKPOINT.value, dtype=_DTYPE.value, seed=_SEED.value, mesh=mesh,
                          layout=mesh_flags.LAYOUT.value, kernels=cli.kernels_value(_KERNELS),
                          check_finite=_CHECK_FINITE.value, kv_cache=_KV_CACHE.value,
                          vision=bool(paths))
    tok = loaded.tokenizer
    if tok is None:
      raise ValueError(f"{_CHECKPOINT.value} has no tokenizer.json; copy the model's tokenizer "
                       "files into the checkpoint directory")
    images = None
    if paths:
      ids, images = _image_inputs(tok, texts[0], paths, loaded.model.vision.config, _CHAT.value)
      prompts = [ids]
    elif _CHAT.value:
      prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    else:
      prompts = [tok.encode(t) for t in texts]
    if _SPEC_K.value < 0:
      raise ValueError(f"--spec_k must be >= 0 (0 = plain decoding), got {_SPEC_K.value}")
    tree = _tree_shape()
    draft, note = None, ""
    if _SPEC_K.value > 0 or tree is not None:
      if _DRAFT.value:
        draft = spec_decode.load_draft(_DRAFT.value, loaded.model)
      elif _CHECKPOINT.value in spec_decode.EMBEDDED_DRAFTS:
        draft = spec_decode.load_draft(_CHECKPOINT.value, loaded.model)
      else:
        note = "(no --draft for this checkpoint: plain decoding)"
    if draft is not None and mesh is not None:
      draft = sharding.shard_model(draft, mesh, mesh_flags.LAYOUT.value)
    if draft is not None:
      kernels_lib.set_kernels(draft, cli.kernels_value(_KERNELS))
    kw = dict(max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
              top_p=_TOP_P.value, seed=_SEED.value, stop_tokens=loaded.stop_tokens,
              max_cache_len=_MAX_CACHE_LEN.value)
    if images is not None:
      kw["images"] = images
    if _STREAM.value:
      if len(prompts) != 1:
        raise ValueError("--stream prints one prompt's tokens as they come: pass --prompt, not a "
                         "--batch_file with several prompts")
      return _stream(loaded, texts[0], prompts[0], draft, tree, note, kw)
    if draft is None:
      out = generate(loaded.model, prompts, **kw)
    else:
      out = spec_decode.generate(loaded.model, draft, prompts, k=_SPEC_K.value, tree=tree, **kw)
  except (ValueError, FileNotFoundError, CheckpointError, ConfigError, TokenizerError,
          DraftConfigError, NotImplementedError, sharding.ShardingError, ImportError) as e:
    return cli.fail("generate", e)

  stops = set(loaded.stop_tokens)
  for text, toks in zip(texts, out.tokens):
    print(f"--- {text}")
    print(text + tok.decode([t for t in toks if t not in stops]))
  if _CHECKPOINT.value.startswith("random:"):
    print("(random weights: the text above is noise; this checks the pipeline, not the model)")
  n = int(out.num_tokens.sum())
  print(f"[{loaded.source}] {len(texts)} prompt(s), {n} new tokens | compile {out.compile_seconds:.2f}"
        f" s ({cli.compile_cache_summary()}) | generation {out.run_seconds:.3f} s = "
        f"{out.tokens_per_second:.1f} tokens/s ({out.tokens_per_second / len(texts):.1f} per "
        "sequence)")
  if draft is not None:
    rates = " ".join(f"{r:.2f}" for r in out.acceptance_rates)
    how = f"tree {tree}" if tree is not None else f"K={_SPEC_K.value}"
    print(f"speculative {how}: acceptance length {out.acceptance_length:.2f} tokens per "
          f"verify step; per-position acceptance {rates}")
  elif note:
    print(note)
  return 0


def _stream(loaded, text, prompt, draft, tree, note, kw) -> int:
  """Prints the continuation chunk by chunk, then one stats line."""
  from maverick import streaming
  tok, stops = loaded.tokenizer, set(loaded.stop_tokens)
  print(f"--- {text}")
  print(text, end="", flush=True)
  new, shown, chunks, spec_rounds, spec_tokens = [], "", [], 0, 0
  for chunk in streaming.stream(loaded.model, prompt, chunk_tokens=_STREAM_CHUNK.value,
                                draft=draft, k=_SPEC_K.value, tree=tree, **kw):
    chunks.append(chunk)
    new += [t for t in chunk.tokens if t not in stops]
    decoded = tok.decode(new)
    if not chunk.done:  # a multi-byte character may be cut at a chunk boundary: hold it back
      decoded = decoded.rstrip("\ufffd")
    if decoded.startswith(shown):
      print(decoded[len(shown):], end="", flush=True)
      shown = decoded
    if draft is not None:
      spec_rounds += int(chunk.output.rounds.sum())
      spec_tokens += int(chunk.output.accepted.sum())
  print()
  n = sum(len(c.tokens) for c in chunks)
  total = sum(c.seconds for c in chunks)
  compile_s = sum(c.output.compile_seconds for c in chunks)
  print(f"[{loaded.source}] streamed {n} new tokens in {len(chunks)} device calls of <= "
        f"{_STREAM_CHUNK.value} | first output after {chunks[0].seconds:.2f} s | total "
        f"{total:.2f} s (compile {compile_s:.2f} s: {cli.compile_cache_summary()}) = "
        f"{n / max(total - compile_s, 1e-9):.1f} "
        "tokens/s without compile")
  if draft is not None:
    al = spec_tokens / max(spec_rounds, 1)
    how = f"tree {tree}" if tree is not None else f"K={_SPEC_K.value}"
    print(f"speculative {how}: acceptance length {al:.2f} tokens per verify step")
  elif note:
    print(note)
  return 0


console_main = cli.console_main(main, __name__)  # the console script `maverick-generate`

if __name__ == "__main__":
  console_main()
