"""maverick-jax: Llama 4 inference in JAX.

    import maverick
    loaded = maverick.load("random:tiny")             # or a converted / HF checkpoint directory
    from maverick.generate import generate
    out = generate(loaded.model, [loaded.tokenizer.encode("def f(x):")], max_new_tokens=32)
"""

from maverick.config import Config
from maverick.loading import Loaded, load

__all__ = ["Config", "Loaded", "load"]
__version__ = "0.1.0"
