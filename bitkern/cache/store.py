"""The in-process kernel map: a miss has the tuner choose and compile the kernel."""

from __future__ import annotations

import os
import threading

from ..ops.matmul import Matmul
from ..tuner import host_cpu, m_bucket, tune

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
                tuned = tune(spec, n, k, bucket, layout, device, profile=tuning_mode() == "profile")
                kernel = tuned.kernel
                kernel.record = tuned.record
                _kernels[key] = kernel
    return kernel


TUNING_MODES = ("profile", "model")


def tuning_mode() -> str:
    """$BITKERN_TUNING: "profile" (default: build and time the top-k candidates) or "model" (cost model
    alone: faster, for tests and cross-compilation)."""
    mode = os.environ.get("BITKERN_TUNING", "profile")
    if mode not in TUNING_MODES:
        raise ValueError(f"BITKERN_TUNING={mode!r} is not known; accepted: {list(TUNING_MODES)}")
    return mode
