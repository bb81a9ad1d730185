"""MoE grouped GEMM (rows sorted by expert): Pallas Mosaic GPU kernel and XLA reference."""

from pallas_kernels.grouped_gemm.api import grouped_matmul, grouped_swiglu, pallas_support, row_tile

__all__ = ["grouped_matmul", "grouped_swiglu", "pallas_support"]
