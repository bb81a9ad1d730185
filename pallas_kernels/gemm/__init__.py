"""Dense GEMM with FP8 (per-token x per-channel scales) and bf16 paths; `gemm_many`: several
weights over one x in one launch."""

from pallas_kernels.gemm.api import (gemm, gemm_many, gemm_many_partials, pallas_support,
                                     pallas_support_many, row_tile)

__all__ = ["gemm", "gemm_many", "gemm_many_partials", "pallas_support", "pallas_support_many"]
