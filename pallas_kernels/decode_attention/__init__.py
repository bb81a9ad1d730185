"""Decode / verify attention over a KV cache (split-K flash-decoding on Hopper)."""

from pallas_kernels.decode_attention.api import (decode_attention, decode_attention_paged,
                                                 packed_rows, pallas_support, pallas_support_paged)
from pallas_kernels.decode_attention.combine import supports_quantize

__all__ = ["decode_attention", "decode_attention_paged", "packed_rows", "pallas_support",
           "pallas_support_paged", "supports_quantize"]
