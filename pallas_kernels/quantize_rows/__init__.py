"""Per-row dynamic FP8 quantization of a GEMM's input rows in one launch."""

from pallas_kernels.quantize_rows.api import pallas_support, quantize_rows

__all__ = ["pallas_support", "quantize_rows"]
