"""EAGLE-3 speculative decoding on device: draft head, chain and tree drafting, lossless verification.

    import maverick, spec_decode
    target = maverick.load()                                   # the embedded model
    draft = spec_decode.load_draft("tiny", target.model)       # its embedded draft head
    out = spec_decode.generate(target.model, draft, [target.tokenizer.encode("def f(x):")], k=3)
    out.tokens, out.acceptance_length, out.acceptance_rates
    tree = spec_decode.generate(target.model, draft, prompts, tree=spec_decode.TreeShape(5, 8, 32))
"""

from __future__ import annotations

import os

from maverick import hub
from spec_decode.checkpoint import (
    export_eagle3, import_eagle3, is_native_draft, load_draft as load_native_draft, save_draft)
from spec_decode.draft import DraftConfigError, Eagle3Config, Eagle3Draft, init_draft
from spec_decode.speculative import SpecGeneration, generate
from spec_decode.tree import TreeShape

_ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "maverick",
                       "assets")
# Drafts shipped with the embedded target models: target name -> draft directory.
EMBEDDED_DRAFTS = {"tiny": os.path.join(_ASSETS, "tiny_eagle3")}
"""The drafts shipped with the embedded targets: target name -> draft directory
(`load_draft("tiny", target)`)."""


def load_draft(source: str, target=None, *, dtype: str | None = None) -> Eagle3Draft:
  """An EAGLE-3 draft for `target` (a maverick Llama4 model, used to validate and to supply the
  lm_head when an EAGLE-3 checkpoint ships none).

  source: an embedded target name ("tiny"), a directory saved by scripts/train_eagle3.py, or an
  EAGLE-3 checkpoint directory (config.json + safetensors: SpecForge / SafeAILab / NVIDIA layout),
  or a Hugging Face repo id of either (needs huggingface_hub).
  """
  tcfg = None if target is None else target.config
  path = EMBEDDED_DRAFTS.get(source, source)
  path = hub.resolve(path)  # a Hugging Face repo id -> its snapshot in the HF cache
  if not os.path.isdir(path):
    raise FileNotFoundError(f"draft {source!r} is not a directory; pass a draft saved by "
                            "scripts/train_eagle3.py, an EAGLE-3 checkpoint directory, or "
                            f"one of {sorted(EMBEDDED_DRAFTS)}")
  if is_native_draft(path):
    return load_native_draft(path, dtype=dtype, target_config=tcfg)
  if tcfg is None:
    raise ValueError("importing an EAGLE-3 checkpoint needs the target model (target=...)")
  return import_eagle3(path, tcfg, dtype=dtype, target_lm_head=target.output_projection())


__all__ = ["DraftConfigError", "EMBEDDED_DRAFTS", "Eagle3Config", "Eagle3Draft", "SpecGeneration",
           "TreeShape", "export_eagle3", "generate", "import_eagle3", "init_draft", "load_draft", "save_draft"]
