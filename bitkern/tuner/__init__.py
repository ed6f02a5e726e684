"""Hardware descriptions (tTile-device), hint-based tile search, the traffic cost model, top-k profiling.

Entry points: `tune(spec, n, k, bucket, layout, device)` -> a compiled kernel and its `TuningRecord`;
`m_bucket(m)`; device descriptions `host_cpu()`, `cuda_device(arch)`, `device_for(target)`.
"""

from .device import CpuDevice, CudaDevice, cuda_device, device_for, host_cpu
from .record import TuningRecord
from .select import M_BUCKETS, Tuned, m_bucket, tune

__all__ = ["CpuDevice", "CudaDevice", "M_BUCKETS", "Tuned", "TuningRecord", "cuda_device", "device_for",
           "host_cpu", "m_bucket", "tune"]
