"""Find the kernel for a call: in this process's map, else in the disk stores (the user's cache, then the read-only
system cache; or the one store a caller names), else tune and build it (under a cross-process lock, so processes
that need the same kernel build it once) and store it in the first.  Where that store holds prebuilt candidates of
the kernel (entries pinned to a configuration, as a GPU kit ships them), tuning times those instead of building;
where no store holds it and this process cannot build (no TVM, or no nvcc for CUDA), the lookup fails with
`KernelNotFound` naming the kernel, without importing TVM.  `prepare_kernel` does what a first call does and says
where the kernel came from."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import threading
from pathlib import Path

from ..ops.matmul import Matmul
from ..tuner.buckets import m_bucket
from ..tuner.device import host_cpu
from . import bound
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
    return _kernel(spec, n, k, m_bucket(m), layout, device, store)[0]


def prepare_kernel(spec: Matmul, n: int, k: int, m: int, layout: str, device=None,
                   store: DiskStore | None = None) -> str:
    """Make ready in this process the kernel that `kernel_for` gives for M rows (as the first call in M's bucket
    would) and say where it came from: "ready" (this process had it), "loaded" (from a cache) or "built"."""
    return _kernel(spec, n, k, m_bucket(m), layout, device or host_cpu(), store)[1]


def _kernel(spec: Matmul, n: int, k: int, bucket: tuple[int, int], layout: str, device, store: DiskStore | None):
    """(the kernel of the bucket, "ready" / "loaded" / "built")."""
    kernel = _kernels.get((spec, n, k, bucket, layout, device.key))
    if kernel is not None:
        return kernel, "ready"
    key = KernelKey(spec, n, k, bucket, layout, device.key)
    with _build_lock:
        kernel = _kernels.get((spec, n, k, bucket, layout, device.key))
        if kernel is not None:
            return kernel, "ready"
        kernel, source = _load_or_build(key, device, _stores(store))
        _kernels[(spec, n, k, bucket, layout, device.key)] = kernel
    return kernel, source


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
                kernel = _kernels[key] = _load_or_build(key, device, _stores(store))[0]
    return kernel


class KernelNotFound(LookupError):
    """A kernel is neither in the cache nor buildable by this process (TVM, or nvcc for CUDA, is missing)."""


def _stores(store: DiskStore | None) -> tuple[DiskStore, ...]:
    """The stores a lookup reads, the first of which it builds into: `store`, else the user's cache and the
    system cache (read-only)."""
    if store is not None:
        return (store,)
    return DiskStore(), DiskStore(system=True, read_only=True)


def _load_or_build(key: KernelKey, device, stores: tuple[DiskStore, ...]):
    """(kernel, "loaded" or "built"): the first stored one, else one built under the first store's build lock and
    stored there; where that store cannot be used (see `DiskStore.building`) the kernel is built in memory only."""
    for store in stores:
        kernel = store.load(key)
        if kernel is not None:
            return kernel, "loaded"
    store = stores[0]
    with store.building(key) as storing:
        kernel = store.load(key) if storing else None  # another process may have built it while we waited
        if kernel is not None:
            return kernel, "loaded"
        tuned, copy_of = _tuned(key, device, stores)
        kernel = tuned.kernel
        kernel.record = tuned.record
        if storing:
            store.save(key, kernel, copy_of)
    return kernel, "built"


def _tuned(key: KernelKey, device, stores: tuple[DiskStore, ...]):
    """(the kernel of `key` with its record, the key of the stored entry it is, if any): the pinned configuration
    built, the fastest of the first store's prebuilt candidates, or the tuner's choice built."""
    from ..tuner import build_pinned, choose, tune

    profile = tuning_mode() == "profile"
    store = stores[0]
    if key.pinned:
        _check_can_build(key, device, stores)
        template, fields = key.pinned.split(":", 1)
        return build_pinned(key.spec, key.n, key.k, key.bucket, key.layout, device, template, json.loads(fields)), None
    prebuilt = store.pinned(key)
    if prebuilt:
        tuned = choose(key.spec, key.n, key.k, key.bucket, key.layout, device, [kernel for _, kernel in prebuilt],
                       profile=profile)
        return tuned, next(stored for stored, kernel in prebuilt if kernel is tuned.kernel)
    _check_can_build(key, device, stores)
    return tune(key.spec, key.n, key.k, key.bucket, key.layout, device, profile=profile), None


def _check_can_build(key: KernelKey, device, stores: tuple[DiskStore, ...]) -> None:
    """Raise KernelNotFound, naming the kernel, unless this process has what building it takes (checked without
    importing anything)."""
    missing = [reason for reason in (missing_compiler(),) if reason]
    if device.kind == "cuda":
        from ..codegen.cuda.compile import find_nvcc

        missing += [] if find_nvcc() is not None else ["nvcc"]
    if missing:
        searched = " nor ".join(str(store.version_dir) for store in stores)
        raise KernelNotFound(f"no kernel for {key.describe()} in {searched}, and this process "
                             f"cannot build one: {' and '.join(missing)} not found.  Build it where they are "
                             f"(python -m bitkern prebuild [--system], or gpu-kit) and import the bundle "
                             f"(python -m bitkern cache import)")


@functools.lru_cache(maxsize=None)
def missing_compiler() -> str | None:
    """What keeps this process from compiling kernels (None: nothing), found without importing TVM: TVM not
    installed, or installed without its compiler library or told to load its runtime alone (TVM_USE_RUNTIME_LIB=1),
    as a deployment that serves prebuilt kernels runs it."""
    spec = importlib.util.find_spec("tvm")
    if spec is None:
        return "TVM (apache-tvm)"
    if os.environ.get("TVM_USE_RUNTIME_LIB") == "1":
        return "TVM's compiler (TVM_USE_RUNTIME_LIB=1 loads its runtime alone)"
    if not any((Path(location) / "lib" / "libtvm_compiler.so").is_file()
               for location in spec.submodule_search_locations or ()):
        return "TVM's compiler (libtvm_compiler.so)"
    return None


def tuning_mode() -> str:
    """$BITKERN_TUNING: "profile" (default: build and time the top-k candidates) or "model" (cost model
    alone: faster, for tests and cross-compilation)."""
    mode = os.environ.get("BITKERN_TUNING", "profile")
    if mode not in TUNING_MODES:
        raise ValueError(f"BITKERN_TUNING={mode!r} is not known; accepted: {list(TUNING_MODES)}")
    return mode


def forget() -> None:
    """Drop this process's map (kernels stay on disk) and the calls bound to its kernels: the next call of each shape
    loads or builds again."""
    with _build_lock:
        _kernels.clear()
        _by_rows.clear()
        bound.clear()
