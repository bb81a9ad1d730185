"""Fused tensor-parallel all-reduce + residual add + RMSNorm (NVLink multimem)."""

from pallas_kernels.allreduce_norm.api import (MAX_ROWS, PAYLOAD_DTYPE, allreduce_residual_norm,
                                               new_semaphores, pallas_support, residual_norm,
                                               shared_semaphores_supported)

__all__ = ["MAX_ROWS", "PAYLOAD_DTYPE", "allreduce_residual_norm", "new_semaphores",
           "pallas_support", "residual_norm", "shared_semaphores_supported"]
