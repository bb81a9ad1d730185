"""`maverick.load`: one entry point for every kind of checkpoint."""

from __future__ import annotations

import dataclasses
import os

from maverick import config as config_lib
from maverick import hub
from maverick import kernels as kernels_lib
from maverick import model as model_lib
from maverick import sharding as sharding_lib
from maverick import tokenizer as tokenizer_lib
from maverick.checkpoint import store
from maverick.checkpoint.hf import CheckpointError
from maverick.quant import config as quant_config
from maverick.quant import convert as quant_convert
from maverick.vision import model as vision_lib

RANDOM_PREFIX = "random:"
# Models shipped inside the package: name -> directory in our checkpoint format.
EMBEDDED = {"tiny": os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny")}
DEFAULT_MODEL = "tiny"
MAX_RANDOM_PARAMS = 2_000_000_000


@dataclasses.dataclass
class Loaded:
  """What `maverick.load` returns: the model (sharded and quantized as asked), its tokenizer
  (None where the source has none) and the source it came from; `.stop_tokens` and `.config` too."""

  model: model_lib.Llama4
  tokenizer: tokenizer_lib.Tokenizer | tokenizer_lib.ByteTokenizer | None
  source: str

  @property
  def config(self) -> config_lib.Config:
    return self.model.config

  @property
  def stop_tokens(self) -> list[int]:
    """EOS ids from the config and the tokenizer: generation stops on any of them."""
    ids = set(self.config.eos_token_ids)
    if self.tokenizer is not None:
      ids |= set(self.tokenizer.eos_ids)
    return sorted(ids)


def load(source: str = DEFAULT_MODEL, *, dtype: str | None = None, mesh=None,
         rules: sharding_lib.Rules = sharding_lib.REPLICATED, seed: int = 0,
         moe_impl: str = "tiles", layout: str = "tp", quant=None,
         kernels: str | None = None, check_finite: bool = True,
         kv_cache: str | None = None, vision: bool = False) -> Loaded:
  """Loads a model and its tokenizer.

  vision: also load the vision tower of a multimodal Hugging Face directory, or of a checkpoint
  converted with it (`model.vision`; `maverick.generate(..., images=...)` then takes images).

  check_finite: scan each tensor of a Hugging Face directory for NaN/inf as it is read (an error
  naming the tensor); False skips the scan for a trusted checkpoint.
  kernels: None (auto: Pallas kernels on a Hopper/Blackwell GPU for calls whose kernel config
  passed its on-device self-check, XLA elsewhere), "xla" or "pallas" (see maverick/kernels.py).

  quant: a `maverick.quant.QuantConfig` to quantize a BF16 model to FP8 after loading (FP8
  checkpoints need none: their quantization is recorded in them).
  kv_cache: for a ModelOpt FP8 Hugging Face directory, "fp8_static" (default when it sets
  kv_cache_quant_algo FP8: its per-layer k/v scales), "fp8" (per-token scales at run time) or
  "bf16" (unquantized, in the model's dtype, the checkpoint's k/v scales dropped: `dtype`, so
  float32 with dtype="float32"). Every other source takes "bf16" as what it already is; a
  converted checkpoint keeps the format it was converted with (scripts/convert_hf.py --kv_cache).

  source:
    - "tiny" (the default): the embedded model trained on the Python standard library
      (maverick/assets/tiny, see its MODEL_CARD.md),
    - a directory converted by scripts/convert_hf.py (holds maverick.json),
    - a Hugging Face Llama 4 directory (config.json + safetensors), read directly,
    - a Hugging Face repo id ("meta-llama/Llama-4-Scout-17B-16E-Instruct"): resolved through the HF
      cache, downloading if needed (needs huggingface_hub; see maverick.hub),
    - "random:<preset>" (e.g. "random:tiny"): random weights of a preset config with a byte-level
      tokenizer, for smoke tests and benchmarks of shapes; its text output is meaningless.

  mesh: a `sharding.make_mesh(...)` mesh; the weights are placed by `layout` ("tp" or "ep", see
  maverick/sharding.py) and generation then runs sharded. Hugging Face directories are read one
  tensor at a time straight into the shardings (each device receives only its slice) and converted
  checkpoints restore straight into them (also across processes after
  `sharding.initialize_distributed`).
  """
  loaded = _load(source, dtype=dtype, mesh=mesh, rules=rules, seed=seed, moe_impl=moe_impl,
                 layout=layout, quant=quant, check_finite=check_finite, kv_cache=kv_cache,
                 vision=vision)
  if mesh is not None and sharding_lib.plan_of(loaded.model) is None:
    sharding_lib.shard_model(loaded.model, mesh, layout)
  kernels_lib.set_kernels(loaded.model, kernels)
  return loaded


def _load(source, *, dtype, mesh, rules, seed, moe_impl, layout, quant, check_finite,
          kv_cache, vision=False) -> Loaded:
  if kv_cache is not None and kv_cache not in quant_config.KV_CHOICES:
    raise CheckpointError(f"kv_cache={kv_cache!r}: use one of {quant_config.KV_CHOICES} (None: "
                          "the checkpoint's own)")
  bf16_kv = kv_cache == quant_config.UNQUANTIZED_KV
  if bf16_kv and quant is not None and quant.kv_cache is not None:
    raise CheckpointError(f"kv_cache='bf16' contradicts quant's kv_cache {quant.kv_cache!r}; "
                          "pass one of them")
  if (kv_cache is not None and not bf16_kv
      and (source in EMBEDDED or source.startswith(RANDOM_PREFIX))):
    raise CheckpointError(f"kv_cache={kv_cache!r} applies to ModelOpt FP8 checkpoints; {source} "
                          "is not one")
  if vision and (source in EMBEDDED or source.startswith(RANDOM_PREFIX)):
    raise CheckpointError(f"vision=True needs a multimodal Hugging Face checkpoint; {source} is "
                          "a text-only model")
  if source in EMBEDDED:
    path = EMBEDDED[source]
    if not store.is_orbax_checkpoint(path):
      raise CheckpointError(f"the embedded model {source!r} is missing from {path}; reinstall "
                            "maverick-jax or rebuild it with scripts/train_target.py")
    source = path
  if source.startswith(RANDOM_PREFIX):
    name = source[len(RANDOM_PREFIX):]
    cfg = config_lib.preset(name)
    if dtype is not None:
      cfg = cfg.replace(dtype=dtype)
    n_params = model_lib.num_params(cfg)
    if n_params > MAX_RANDOM_PARAMS:
      raise ValueError(f"random:{name} would allocate {n_params / 1e9:.0f}B parameters on this "
                       f"host; random init is limited to {MAX_RANDOM_PARAMS / 1e9:.0f}B. Use a "
                       "small preset, or a real checkpoint with sharding")
    tok = tokenizer_lib.ByteTokenizer()
    if cfg.vocab_size < tok.vocab_size:
      raise ValueError(f"preset {name!r} has vocab_size {cfg.vocab_size} < {tok.vocab_size} "
                       "needed by the byte tokenizer of random models")
    model = model_lib.init_model(cfg, seed=seed, moe_impl=moe_impl)
    return Loaded(_quantized(model, quant, moe_impl), tok, source)
  source = hub.resolve(source)  # a Hugging Face repo id -> its snapshot in the HF cache
  if not os.path.isdir(source):
    raise FileNotFoundError(f"checkpoint {source!r} is not a directory; pass {DEFAULT_MODEL!r} "
                            "(embedded), a converted checkpoint, a Hugging Face Llama 4 directory "
                            "or repo id (owner/name), "
                            f"or random:<preset> (presets: {', '.join(sorted(config_lib.PRESETS))})")
  if store.is_orbax_checkpoint(source) and kv_cache is not None:
    recorded = (store.read_meta(source).get("config", {}).get("quant") or {}).get("kv_cache")
    if not (bf16_kv and recorded is None):  # "bf16" is what its cache is already
      raise CheckpointError(
          f"kv_cache={kv_cache!r} is chosen when a ModelOpt checkpoint is read or converted; "
          f"{source} is converted already, with kv_cache {recorded or 'bf16'!r} (rerun "
          "scripts/convert_hf.py with --kv_cache)")
    kv_cache = None
  if store.is_orbax_checkpoint(source) and mesh is not None:
    model = store.load_orbax_sharded(source, mesh, layout, dtype=dtype, moe_impl=moe_impl,
                                     vision=vision)
  elif store.is_orbax_checkpoint(source):
    model = store.load_orbax(source, mesh=mesh, rules=rules, dtype=dtype, moe_impl=moe_impl,
                             vision=vision)
  elif os.path.isfile(os.path.join(source, "config.json")):
    # With a mesh each tensor goes straight into its shards (no device holds a whole tensor).
    model = store.load_hf(source, dtype=dtype, moe_impl=moe_impl, check_finite=check_finite,
                          kv_cache=kv_cache, mesh=mesh, layout=layout, vision=vision)
  else:
    raise CheckpointError(f"{source} holds neither {store.META_FILE} (converted checkpoint) nor "
                          "config.json (Hugging Face checkpoint)")
  return Loaded(_quantized(model, quant, moe_impl), tokenizer_lib.load_tokenizer(source), source)


def _quantized(model, quant, moe_impl):
  if quant is None:
    return model
  tower = vision_lib.tower_of(model)
  quantized = quant_convert.quantize_model(model, quant, moe_impl=moe_impl)
  # the text model is rebuilt quantized; the vision tower stays as loaded (never FP8)
  return quantized if tower is None else vision_lib.attach(quantized, tower)
