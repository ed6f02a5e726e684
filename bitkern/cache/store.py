"""The in-process kernel map: a miss asks the tuner for a configuration and compiles it."""

from __future__ import annotations

import threading

from ..codegen.cpu.kernel import build_kernel
from ..ops.matmul import Matmul
from ..tuner import choose, host_cpu, m_bucket

_kernels: dict = {}
_build_lock = threading.Lock()


def kernel_for(spec: Matmul, n: int, k: int, m: int, layout: str, device=None):
    """The compiled kernel serving `spec` on a [N, K] weight in `layout` for M rows on `device`."""
    device = device or host_cpu()
    bucket = m_bucket(m)
    key = (spec, n, k, bucket, layout, device.key)
    kernel = _kernels.get(key)
    if kernel is None:
        with _build_lock:
            kernel = _kernels.get(key)
            if kernel is None:
                choice = choose(spec, n, k, bucket, layout, device)
                kernel = build_kernel(spec, n, k, choice.template, choice.config, layout, bucket, device)
                _kernels[key] = kernel
    return kernel
