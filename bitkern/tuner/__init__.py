"""Hardware descriptions (tTile-device), hint-based tile search, the traffic cost model, top-k profiling.

Entry points: `tune(spec, n, k, bucket, layout, device)` -> a compiled kernel and its `TuningRecord`
(`shortlist`: the candidates it would time; `choose`: the fastest of compiled ones; `build_pinned`: one
configuration);
`m_bucket(m)`; device descriptions `host_cpu()`, `cuda_device(arch)`, `device_for(target)`.  The search
needs the TVM compiler and is imported on first use, so finding a kernel in the cache never loads it.
"""

from .buckets import M_BUCKETS, TUNED_M, m_bucket
from .device import CpuDevice, CudaDevice, cuda_device, device_for, host_cpu

_SEARCH = {"tune": "select", "Tuned": "select", "TuningRecord": "record", "choose": "select", "build_pinned": "select",
           "shortlist": "select"}


def __getattr__(name):
    if name in _SEARCH:
        import importlib

        return getattr(importlib.import_module(f".{_SEARCH[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CpuDevice", "CudaDevice", "M_BUCKETS", "TUNED_M", "Tuned", "TuningRecord", "build_pinned", "choose",
           "cuda_device", "device_for", "host_cpu", "m_bucket", "shortlist", "tune"]
