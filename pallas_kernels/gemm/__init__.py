"""Dense GEMM with FP8 (per-token x per-channel scales) and bf16 paths."""

from pallas_kernels.gemm.api import gemm, pallas_support, row_tile

__all__ = ["gemm", "pallas_support"]
