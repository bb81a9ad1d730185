"""Per-row dynamic FP8 quantization of a GEMM's input rows in one launch (plain rows, or an MLP's
SwiGLU made from its gate / up GEMM outputs on the way)."""

from pallas_kernels.quantize_rows.api import (pallas_support, quantize_rows,
                                              swiglu_and_quantize_rows, swiglu_quantize_rows)

__all__ = ["pallas_support", "quantize_rows", "swiglu_and_quantize_rows", "swiglu_quantize_rows"]
