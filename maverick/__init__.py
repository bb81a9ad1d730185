"""maverick-jax: Llama 4 inference in JAX.

    import maverick
    loaded = maverick.load()                 # the embedded model; or a converted / HF directory
    from maverick.generate import generate
    out = generate(loaded.model, [loaded.tokenizer.encode("def f(x):")], max_new_tokens=32)

Speculative decoding lives in the sibling package `spec_decode`.
"""

__version__ = "0.1.0"
__all__ = ["Config", "Loaded", "load"]


def __getattr__(name):
  # Lazy: `import maverick.cli` (CLI --help, argument errors) must not pay for importing jax.
  if name == "Config":
    from maverick.config import Config
    return Config
  if name in ("Loaded", "load"):
    from maverick import loading
    return getattr(loading, name)
  raise AttributeError(f"module 'maverick' has no attribute {name!r}")
