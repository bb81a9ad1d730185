"""Prefill (flash) attention: causal GQA over a prompt, global or Llama 4 chunked."""

from pallas_kernels.prefill_attention.api import pallas_support, prefill_attention

__all__ = ["pallas_support", "prefill_attention"]
