"""Quantizes a BF16 checkpoint to FP8 (e4m3 weights with per-output-channel scales), streaming.

One layer is in memory at a time; the output is our checkpoint format with the quantization config
recorded in maverick.json, so `maverick.load(out_dir)` (and every script's --checkpoint) builds the
FP8 model from it. The output appears at --out_dir only when the whole checkpoint is written; a
NaN/inf weight aborts with the weight's name and nothing written.

  python scripts/quantize.py --src tiny --out_dir /tmp/tiny-fp8
  python scripts/quantize.py --src /ckpt/maverick --out_dir /ckpt/maverick-fp8 --kv_cache fp8 \\
      --skip embed,lm_head,router,attn

Run as `maverick-quantize` (an installed maverick-jax's console script), as
`python -m maverick.commands.quantize`, or from a source checkout as
`python scripts/quantize.py`.
"""

import os

from absl import flags

from maverick import cli

_SRC = flags.DEFINE_string(
    "src", "tiny", "BF16 source: an embedded model name ('tiny'), a checkpoint converted by "
    "scripts/convert_hf.py, or a Hugging Face BF16 directory (config.json + safetensors).")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Output directory for the FP8 checkpoint.")
_ACTIVATIONS = flags.DEFINE_enum(
    "activations", "dynamic_per_token", ["dynamic_per_token", "none"],
    "Activation quantization at run time: per-token dynamic FP8 (FP8 x FP8 GEMMs) or none "
    "(weight-only: BF16 activations).")
_KV_CACHE = flags.DEFINE_enum("kv_cache", "bf16", ["bf16", "fp8"],
                              "KV cache format recorded in the checkpoint (bf16: unquantized, in "
                              "the model dtype; fp8: e4m3 with a scale per token and KV head).")
_SKIP = flags.DEFINE_list(
    "skip", ["embed", "lm_head", "router"],
    "Weights kept in BF16: kinds (embed, lm_head, router, attn, mlp, shared, experts) or glob "
    "patterns over names like layers.47.experts.gate.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False,
                               "Replace --out_dir if it holds a previous maverick checkpoint.")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar on stderr.")


def main(argv):
  try:
    cli.start(argv)
  except cli.UsageError as e:
    return cli.fail("quantize", e)
  if _OUT_DIR.value is None:
    return cli.fail("quantize", "--out_dir is required")
  if os.path.lexists(_OUT_DIR.value) and not _OVERWRITE.value:
    return cli.fail("quantize",
                    f"--out_dir {_OUT_DIR.value} already exists; choose another or pass --overwrite")

  from maverick import loading, quant
  from maverick.checkpoint import CheckpointError
  from maverick.config import ConfigError

  src = loading.EMBEDDED.get(_SRC.value, _SRC.value)
  if not os.path.isdir(src):
    return cli.fail("quantize", f"--src {_SRC.value} is not a directory or an embedded model "
                    f"({', '.join(sorted(loading.EMBEDDED))})")
  try:
    qc = quant.QuantConfig(weights="fp8", activations=_ACTIVATIONS.value,
                           kv_cache=_KV_CACHE.value,
                           skip=tuple(_SKIP.value))
    out = quant.quantize_checkpoint(src, _OUT_DIR.value, qc, overwrite=_OVERWRITE.value,
                                    progress=_PROGRESS.value)
  except (CheckpointError, ConfigError, quant.QuantError, quant.QuantConfigError,
          FileExistsError, FileNotFoundError, PermissionError) as e:
    return cli.fail("quantize", e)
  except KeyboardInterrupt:
    return cli.fail("quantize", f"interrupted; nothing was written to {_OUT_DIR.value}")
  size = lambda d: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
  print(f"quantized {src} -> {out} ({size(src) / 1e6:.1f} MB -> {size(out) / 1e6:.1f} MB)")
  return 0


console_main = cli.console_main(main, __name__)  # the console script `maverick-quantize`

if __name__ == "__main__":
  console_main()
