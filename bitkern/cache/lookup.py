"""Find the kernel for a call: in this process's map, else in the disk store, else tune and build it
(under a cross-process lock, so processes that need the same kernel build it once) and store it."""

from __future__ import annotations

import os
import threading

from ..ops.matmul import Matmul
from ..tuner.buckets import m_bucket
from ..tuner.device import host_cpu
from .disk import DiskStore
from .key import KernelKey

TUNING_MODES = ("profile", "model")
SHORTCUT_ROWS = 128  # host-CPU kernels found for these row counts are remembered by M itself
_kernels: dict = {}
_by_rows: dict = {}  # (spec, N, K, M, layout) -> host-CPU kernel: skips the device and bucket lookups
_build_lock = threading.Lock()


def kernel_for(spec: Matmul, n: int, k: int, m: int, layout: str, device=None, store: DiskStore | None = None):
    """The compiled kernel serving `spec` on a [N, K] weight in `layout` for M rows on `device` (None: this
    CPU)."""
    if device is None:
        if store is not None:
            return kernel_for(spec, n, k, m, layout, host_cpu(), store)
        kernel = _by_rows.get((spec, n, k, m, layout))
        if kernel is None:
            kernel = kernel_for(spec, n, k, m, layout, host_cpu())
            if m <= SHORTCUT_ROWS:
                _by_rows[(spec, n, k, m, layout)] = kernel
        return kernel
    bucket = m_bucket(m)
    kernel = _kernels.get((spec, n, k, bucket, layout, device.key))
    if kernel is not None:
        return kernel
    key = KernelKey(spec, n, k, bucket, layout, device.key)
    with _build_lock:
        kernel = _kernels.get((spec, n, k, bucket, layout, device.key))
        if kernel is None:
            kernel = _load_or_build(key, device, store or DiskStore())
            _kernels[(spec, n, k, bucket, layout, device.key)] = kernel
    return kernel


def _load_or_build(key: KernelKey, device, store: DiskStore):
    """The stored kernel, else one built under the store's build lock and stored; where the store cannot be
    used (see `DiskStore.building`) the kernel is built in memory only."""
    kernel = store.load(key)
    if kernel is not None:
        return kernel
    with store.building(key) as storing:
        kernel = store.load(key) if storing else None  # another process may have built it while we waited
        if kernel is None:
            from ..tuner import tune

            tuned = tune(key.spec, key.n, key.k, key.bucket, key.layout, device,
                         profile=tuning_mode() == "profile")
            kernel = tuned.kernel
            kernel.record = tuned.record
            if storing:
                store.save(key, kernel)
    return kernel


def tuning_mode() -> str:
    """$BITKERN_TUNING: "profile" (default: build and time the top-k candidates) or "model" (cost model
    alone: faster, for tests and cross-compilation)."""
    mode = os.environ.get("BITKERN_TUNING", "profile")
    if mode not in TUNING_MODES:
        raise ValueError(f"BITKERN_TUNING={mode!r} is not known; accepted: {list(TUNING_MODES)}")
    return mode


def forget() -> None:
    """Drop this process's map (kernels stay on disk): the next call of each shape loads or builds again."""
    with _build_lock:
        _kernels.clear()
        _by_rows.clear()
