"""Compiled kernels keyed by (op spec, N, K, M bucket, weight layout, target): built once per process.

Entry point: `kernel_for(spec, n, k, m, layout, device)`.
"""

from .store import kernel_for

__all__ = ["kernel_for"]
