"""Hardware descriptions (tTile-device) and the choice of template and tile configuration per kernel.

Entry points: `host_cpu()`, `choose(spec, n, k, bucket, layout, device)`, `m_bucket(m)`.
"""

from .device import CpuDevice, host_cpu
from .select import M_BUCKETS, Choice, choose, m_bucket

__all__ = ["CpuDevice", "Choice", "M_BUCKETS", "choose", "host_cpu", "m_bucket"]
