"""Find the kernel for a call: in this process's map, else in the disk store, else tune and build it
(under a cross-process lock, so processes that need the same kernel build it once) and store it.  Where the store
holds prebuilt candidates of the kernel (entries pinned to a configuration, as a GPU kit ships them), tuning times
those instead of building; where it holds nothing and this process cannot build (no TVM, or no nvcc for CUDA),
the lookup fails with `KernelNotFound` naming the kernel, without importing TVM."""

from __future__ import annotations

import importlib.util
import json
import os
import threading

from ..ops.matmul import Matmul
from ..tuner.buckets import m_bucket
from ..tuner.device import host_cpu
from .disk import DiskStore
from .key import KernelKey, pinned_name

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


def pinned_kernel(spec: Matmul, n: int, k: int, bucket: tuple[int, int], layout: str, device, template: str, config,
                  store: DiskStore | None = None):
    """The kernel of one configuration of `template` (not the tuner's choice) for rows in `bucket` on `device`:
    from this process's map, the disk store, else built and stored (as `KernelKey.pinned` entries)."""
    key = KernelKey(spec, n, k, tuple(bucket), str(layout), device.key, pinned_name(template, config))
    kernel = _kernels.get(key)
    if kernel is None:
        with _build_lock:
            kernel = _kernels.get(key)
            if kernel is None:
                kernel = _kernels[key] = _load_or_build(key, device, store or DiskStore())
    return kernel


class KernelNotFound(LookupError):
    """A kernel is neither in the cache nor buildable by this process (TVM, or nvcc for CUDA, is missing)."""


def _load_or_build(key: KernelKey, device, store: DiskStore):
    """The stored kernel, else one built under the store's build lock and stored; where the store cannot be
    used (see `DiskStore.building`) the kernel is built in memory only."""
    kernel = store.load(key)
    if kernel is not None:
        return kernel
    with store.building(key) as storing:
        kernel = store.load(key) if storing else None  # another process may have built it while we waited
        if kernel is None:
            tuned, copy_of = _tuned(key, device, store)
            kernel = tuned.kernel
            kernel.record = tuned.record
            if storing:
                store.save(key, kernel, copy_of)
    return kernel


def _tuned(key: KernelKey, device, store: DiskStore):
    """(the kernel of `key` with its record, the key of the stored entry it is, if any): the pinned configuration
    built, the fastest of the store's prebuilt candidates, or the tuner's choice built."""
    from ..tuner import build_pinned, choose, tune

    profile = tuning_mode() == "profile"
    if key.pinned:
        _check_can_build(key, device, store)
        template, fields = key.pinned.split(":", 1)
        return build_pinned(key.spec, key.n, key.k, key.bucket, key.layout, device, template, json.loads(fields)), None
    prebuilt = store.pinned(key)
    if prebuilt:
        tuned = choose(key.spec, key.n, key.k, key.bucket, key.layout, device, [kernel for _, kernel in prebuilt],
                       profile=profile)
        return tuned, next(stored for stored, kernel in prebuilt if kernel is tuned.kernel)
    _check_can_build(key, device, store)
    return tune(key.spec, key.n, key.k, key.bucket, key.layout, device, profile=profile), None


def _check_can_build(key: KernelKey, device, store: DiskStore) -> None:
    """Raise KernelNotFound, naming the kernel, unless this process has what building it takes (checked without
    importing anything)."""
    missing = [] if importlib.util.find_spec("tvm") is not None else ["TVM (apache-tvm)"]
    if device.kind == "cuda":
        from ..codegen.cuda.compile import find_nvcc

        missing += [] if find_nvcc() is not None else ["nvcc"]
    if missing:
        raise KernelNotFound(f"no kernel for {key.describe()} in the cache {store.version_dir}, and this process "
                             f"cannot build one: {' and '.join(missing)} not found.  Build it where they are "
                             f"(python -m bitkern prebuild, or gpu-kit) and import the bundle "
                             f"(python -m bitkern cache import)")


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
