"""maverick-jax: Llama 4 inference in JAX.

The public surface is small:

    import maverick, spec_decode
    loaded = maverick.load()                 # embedded model; a converted / HF dir; an HF repo id
    prompts = [loaded.tokenizer.encode("def f(x):")]
    out = maverick.generate(loaded.model, prompts, max_new_tokens=32)      # plain decoding
    draft = spec_decode.load_draft("tiny", loaded.model)
    out = spec_decode.generate(loaded.model, draft, prompts, k=3)          # EAGLE-3 speculative

`maverick.generate` is the function `maverick.generation.generate` (the generation module holds
`prepare`, `compiled_generate`, ...). Kernels live in `pallas_kernels`, speculative decoding in
`spec_decode`. Importing `maverick` does not import jax (CLI --help stays instant); on a CUDA host it
adds the XLA flags that keep the generate loops on the GPU (`maverick.gpu_flags`) unless jax's
backend has already started.

The modules are layered, bottom to top (pallas_kernels, config, primitives, model, sharding,
checkpoint formats, loading, generation, spec_decode, applications): a module imports only its own
layer or lower. ARCHITECTURE.md at the repository root describes the layers; maverick/layers.py
is the table tests/test_layering.py checks.
"""


def _version() -> str:
  """The version of the installed distribution (its metadata, from pyproject.toml at build time);
  from a source checkout that is not installed, pyproject.toml's own; else "0+unknown"."""
  from importlib import metadata  # noqa: PLC0415
  try:
    return metadata.version("maverick-jax")
  except metadata.PackageNotFoundError:
    pass
  import os  # noqa: PLC0415
  import tomllib  # noqa: PLC0415
  try:
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "pyproject.toml"), "rb") as f:
      project = tomllib.load(f).get("project", {})
  except (OSError, tomllib.TOMLDecodeError):
    return "0+unknown"
  if project.get("name") != "maverick-jax":
    return "0+unknown"
  return project.get("version", "0+unknown")


__version__ = _version()

# XLA reads XLA_FLAGS once, when the backend starts: set the on-device while-loop flags now (GPU
# only, user's XLA_FLAGS entries win, MAVERICK_GPU_LOOP_FLAGS=0 turns it off; see gpu_flags.py).
from maverick import gpu_flags as _gpu_flags  # noqa: E402  (stdlib only: no jax import)

_gpu_flags.configure()
__all__ = ["Config", "Loaded", "generate", "load"]


def __getattr__(name):
  # Lazy: `import maverick.cli` (CLI --help, argument errors) must not pay for importing jax.
  if name == "Config":
    from maverick.config import Config
    return Config
  if name in ("Loaded", "load"):
    from maverick import loading
    return getattr(loading, name)
  if name == "generate":
    from maverick.generation import generate
    return generate
  raise AttributeError(f"module 'maverick' has no attribute {name!r}")
