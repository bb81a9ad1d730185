"""Pallas Mosaic GPU kernels, one folder per op, each with a plain-jnp reference behind the same
`implementation="xla" | "pallas" | None` switch (see `common`)."""

from pallas_kernels.common import (IMPLEMENTATIONS, KernelInputError, gpu_arch, interpret,
                                   lower_for_gpu)

__all__ = ["IMPLEMENTATIONS", "KernelInputError", "gpu_arch", "interpret", "lower_for_gpu"]
