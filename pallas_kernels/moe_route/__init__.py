"""Llama 4's top-1 MoE routing from the router GEMM's output in one launch."""

from pallas_kernels.moe_route.api import pallas_support, route_top1

__all__ = ["pallas_support", "route_top1"]
