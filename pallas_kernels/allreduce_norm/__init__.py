"""Fused tensor-parallel all-reduce + residual add + RMSNorm (NVLink multimem)."""

from pallas_kernels.allreduce_norm.api import (PAYLOAD_DTYPE, allreduce_residual_norm,
                                               pallas_support, residual_norm)

__all__ = ["PAYLOAD_DTYPE", "allreduce_residual_norm", "pallas_support", "residual_norm"]
