"""The layers of maverick-jax, bottom to top: the one table ARCHITECTURE.md describes and
tests/test_layering.py enforces.

A module may import only modules of its own layer or of a lower one, with no cycle inside a layer,
and never its own package's `__init__` (a package's `__init__` is the top of its package: it
re-exports its submodules, so the submodules import each other, not the package). Every module
under maverick/, spec_decode/ and pallas_kernels/ must match an entry: a module name ("maverick.model",
which also names a package's `__init__`: "maverick.quant"), or a name ending in ".*" for a package
and everything under it ("spec_decode.*"). The most specific entry wins.

Standard library only: `import maverick` must stay free of jax.
"""

from __future__ import annotations

# (layer name, what it holds, module entries), bottom to top.
LAYERS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("pallas_kernels", "the Pallas Mosaic GPU kernels and their XLA references; imports no maverick",
     ("pallas_kernels.*",)),
    ("config", "model and quantization configs; the XLA flags set at import",
     ("maverick.gpu_flags", "maverick.quant.config", "maverick.config")),
    ("primitives", "FP8 primitives, kernel dispatch, the quantized contraction, the sharding plan, "
     "sampling, the KV cache, tokenizers, text corpora, the exported-program cache, "
     "image preprocessing",
     ("maverick.quant.ops", "maverick.kernels", "maverick.kernel_attention", "maverick.kernel_moe",
      "maverick.multi_linear", "maverick.fused_mlp", "maverick.fused_attention",
      "maverick.quant.contraction",
      "maverick.sharding_plan", "maverick.sampling", "maverick.kv_cache", "maverick.tokenizer",
      "maverick.data", "maverick.program_cache", "maverick.vision.*")),
    ("model", "the Llama 4 model, its MoE, the vision tower, and the description of its weights",
     ("maverick.moe", "maverick.model", "maverick.weights", "maverick.vision.model")),
    ("sharding", "placing a model on a mesh",
     ("maverick.sharding", "maverick.mesh_flags")),
    ("checkpoint", "checkpoint formats (HF BF16 / FP8 / ModelOpt, ours), FP8 conversion, the HF Hub",
     ("maverick.checkpoint.*", "maverick.quant.convert", "maverick.quant", "maverick.hub")),
    ("loading", "maverick.load: any source to a (sharded) model + tokenizer",
     ("maverick.loading",)),
    ("generation", "plain generation, FP8 parity, target training",
     ("maverick.generation", "maverick.quant.parity", "maverick.train")),
    ("spec_decode", "EAGLE-3 speculative decoding",
     ("spec_decode.*",)),
    ("applications", "serving (image requests too), streaming, memory planning, evaluation, profiling, kernel sweeps, "
     "launch counts and the modeled step time, CLI plumbing, the public `maverick` package",
     ("maverick.serving.*", "maverick.streaming", "maverick.memory_plan", "maverick.evaluation",
      "maverick.profiling", "maverick.kernel_sweep", "maverick.launches", "maverick.step_model",
      "maverick.cli", "maverick.layers", "maverick")),
    ("commands", "the command-line programs (console scripts maverick-generate, ...)",
     ("maverick.commands.*",)),
)

# The source roots the table covers (scripts/, benchmarks/, tools/ and tests/ sit above them all).
PACKAGES = ("maverick", "spec_decode", "pallas_kernels")


def matches(entry: str, module: str) -> bool:
  if entry.endswith(".*"):
    base = entry[:-2]
    return module == base or module.startswith(base + ".")
  return module == entry


def layer_of(module: str, layers=LAYERS) -> int | None:
  """The index (0 = bottom) of `module`'s layer: its most specific entry's; None when no entry
  matches."""
  best = None  # (specificity, layer)
  for i, (_, _, entries) in enumerate(layers):
    for entry in entries:
      if matches(entry, module):
        rank = (0 if entry.endswith(".*") else 1, len(entry))
        if best is None or rank > best[0]:
          best = (rank, i)
  return None if best is None else best[1]
