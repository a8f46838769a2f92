"""Native transfer executors: the pure-torch reference (CPU, the oracle) and the CUDA kernels."""

from .reference import ReferenceExecutor, gather_staged, plane_view, scatter_staged

__all__ = ["ReferenceExecutor", "gather_staged", "plane_view", "scatter_staged"]
