"""The M buckets: each is served by one compiled kernel whose M is symbolic, tuned at a representative M.

M = 1 (token-by-token decoding's GEMV: its kernels carry the body for one row only, so they compile fastest),
2..4 (decode-bound GEMV shapes: the lookup template competes), 5..16 (one AMX block of M rows), 17..128 and
129.. (blocked AMX GEMM).  The bucket is part of the cache key and of the tuning record.
"""

from __future__ import annotations

M_BUCKETS = ((1, 1), (2, 4), (5, 16), (17, 128), (129, 2**31 - 1))
TUNED_M = {(1, 1): 1, (2, 4): 4, (5, 16): 16, (17, 128): 64, (129, 2**31 - 1): 256}


def m_bucket(m: int) -> tuple[int, int]:
    """The bucket of rows M (inclusive bounds) whose kernel serves M."""
    if m < 1:
        raise ValueError(f"m={m}: a kernel serves at least one row")
    return next(bucket for bucket in M_BUCKETS if bucket[0] <= m <= bucket[1])
