"""Compiled kernels keyed by (op spec, N, K, M bucket, weight layout, target, versions): an in-process map
over an on-disk store under $BITKERN_CACHE_DIR (else $XDG_CACHE_HOME/bitkern, else ~/.cache/bitkern).

Entry point: `kernel_for(spec, n, k, m, layout, device)`; the store itself is `DiskStore` (ls, verify,
clear, export and import of bundles).
"""

from .disk import DiskStore, cache_root
from .key import KernelKey, versions
from .lookup import forget, kernel_for, tuning_mode

__all__ = ["DiskStore", "KernelKey", "cache_root", "forget", "kernel_for", "tuning_mode", "versions"]
