"""Converts a Hugging Face Llama 4 checkpoint to the maverick orbax format.

Reads config.json and model.safetensors (or sharded model-*.safetensors with
model.safetensors.index.json) from --hf_dir; both the text-only (Llama4ForCausalLM) and the
multimodal (Llama4ForConditionalGeneration, `language_model.` keys) layouts are accepted; the vision
tower of a multimodal checkpoint is converted too (in the model dtype, never FP8), unless --text_only.
FP8 checkpoints (compressed-tensors, fbgemm, NVIDIA ModelOpt) stay FP8. Every tensor name, shape and
dtype is checked against config.json before anything is written. The output appears at --out_dir
only when the conversion succeeds.

Usage:
  python scripts/convert_hf.py --hf_dir=/ckpt/Llama-4-Scout-17B-16E-Instruct --out_dir=/ckpt/scout

Run as `maverick-convert` (an installed maverick-jax's console script), as
`python -m maverick.commands.convert_hf`, or from a source checkout as
`python scripts/convert_hf.py`.
"""

import os
import signal

from absl import flags

# Runnable from a source checkout without `pip install -e .`.
from maverick import cli

_HF_DIR = flags.DEFINE_string(
    "hf_dir", None,
    "Hugging Face checkpoint directory: config.json plus model.safetensors, or sharded "
    "model-*.safetensors with model.safetensors.index.json.")
_OUT_DIR = flags.DEFINE_string(
    "out_dir", None,
    "Output directory for the converted checkpoint. Must not exist unless --overwrite; written "
    "to a temporary sibling and renamed into place only on success.")
_DTYPE = flags.DEFINE_enum(
    "dtype", None, ["float32", "bfloat16", "float16"],
    "Parameter dtype of the converted checkpoint. Default: the dtype in config.json "
    "(bfloat16 for the released Llama 4 models).")
_OVERWRITE = flags.DEFINE_bool(
    "overwrite", False,
    "Replace --out_dir if it holds a previous maverick checkpoint (any other existing path is "
    "refused).")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar on stderr.")
_TEXT_ONLY = flags.DEFINE_bool(
    "text_only", False, "Skip the vision tower of a multimodal checkpoint (vision_model.*, "
    "multi_modal_projector.*). Default: a checkpoint whose config.json has a vision_config is "
    "converted with its tower (load it with maverick.load(..., vision=True)).")
_CHECK_FINITE = cli.define_check_finite_flag()
_ACTIVATIONS = flags.DEFINE_enum(
    "activations", None, ["static_per_tensor", "dynamic_per_token"],
    "NVIDIA ModelOpt FP8 checkpoints only: quantize activations with the checkpoint's static "
    "per-tensor input scales (the default, as TensorRT-LLM and vLLM run it) or per token at run "
    "time (the input scales are then dropped).")
_KV_CACHE = cli.define_kv_cache_flag()



def main(argv):
  # orbax logs every save step at INFO; keep the progress bar readable unless -v is given.
  try:
    cli.start(argv)
  except cli.UsageError as e:
    return cli.fail("convert_hf", e)
  hf_dir = _HF_DIR.value
  if not os.path.isdir(hf_dir):
    return cli.fail("convert_hf", f"--hf_dir {hf_dir} is not a directory")
  # Checked here too so the mistake is reported before the slow imports and the header scan.
  if os.path.lexists(_OUT_DIR.value) and not _OVERWRITE.value:
    return cli.fail("convert_hf",
                    f"--out_dir {_OUT_DIR.value} already exists; choose another or pass --overwrite")

  # Imported late: jax and orbax take seconds to import, which --help and the checks above skip.
  from maverick.checkpoint import CheckpointError, convert_hf_to_orbax
  from maverick.config import ConfigError

  from maverick.checkpoint import hf

  def interrupted(signum, frame):
    # Ctrl-C and SIGTERM (kill, a job scheduler) stop at the next tensor and clean up; a second
    # one stops at once.
    if hf.interrupt.is_set():
      raise KeyboardInterrupt
    hf.interrupt.set()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, interrupted)
  try:
    out = convert_hf_to_orbax(hf_dir, _OUT_DIR.value, dtype=_DTYPE.value,
                              check_finite=_CHECK_FINITE.value, activations=_ACTIVATIONS.value,
                              kv_cache=_KV_CACHE.value, vision=_has_vision(hf_dir),
                              overwrite=_OVERWRITE.value, progress=_PROGRESS.value)
  except (CheckpointError, ConfigError, FileExistsError, PermissionError) as e:
    # User mistakes: one line, no traceback. Anything else is a bug and keeps its traceback.
    return cli.fail("convert_hf", e)
  except KeyboardInterrupt:
    return cli.fail("convert_hf", f"interrupted; nothing was written to {_OUT_DIR.value}")
  print(f"converted {hf_dir} -> {out}")
  return 0


def _has_vision(hf_dir: str) -> bool:
  if _TEXT_ONLY.value:
    return False
  import json
  try:
    with open(os.path.join(hf_dir, "config.json")) as f:
      return isinstance(json.load(f).get("vision_config"), dict)
  except (OSError, ValueError, AttributeError):
    return False  # the converter reports a missing or malformed config.json itself


def console_main() -> None:
  """The console entry point `maverick-convert`."""
  flags.mark_flags_as_required(["hf_dir", "out_dir"])
  cli.run_app(main, __name__)


if __name__ == "__main__":
  console_main()
