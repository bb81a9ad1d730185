"""An attention layer's q / k / v GEMM output finished in one launch: split-K sum, RoPE, QK norm,
temperature, the KV-cache append in place, and the query packed for the decode kernel."""

from pallas_kernels.qkv_finish.api import MAX_ROWS, Layer, pallas_support, qkv_finish

__all__ = ["MAX_ROWS", "Layer", "pallas_support", "qkv_finish"]
