"""Dispatch of a call to its kernel, and compiled kernels keyed by (op spec, N, K, M bucket, weight layout,
target, versions): an in-process map over an on-disk store under $BITKERN_CACHE_DIR (else
$XDG_CACHE_HOME/bitkern, else ~/.cache/bitkern) and a read-only system store under $BITKERN_SYSTEM_CACHE_DIR
(else /usr/local/share/bitkern/cache).

Entry points: `kernel_for(spec, n, k, m, layout, device)` (`pinned_kernel` for one template configuration;
`prepare_kernel` makes one ready ahead of its first call);
`dispatch.run(spec, x, weight, bias)`, which importing this package attaches to `bitkern.ops` (what calling a
spec does); the store itself is `DiskStore` (ls, verify, clear, export and import of bundles).
"""

from . import dispatch
from .disk import DiskStore, cache_root, system_cache_root
from .key import KernelKey, versions
from .lookup import KernelNotFound, forget, kernel_for, pinned_kernel, prepare_kernel, tuning_mode

__all__ = ["DiskStore", "KernelKey", "KernelNotFound", "cache_root", "dispatch", "forget", "kernel_for", "pinned_kernel",
           "prepare_kernel", "system_cache_root", "tuning_mode", "versions"]
