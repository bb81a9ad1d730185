"""Decode / verify attention over a KV cache (split-K flash-decoding on Hopper)."""

from pallas_kernels.decode_attention.api import decode_attention, pallas_support

__all__ = ["decode_attention", "pallas_support"]
