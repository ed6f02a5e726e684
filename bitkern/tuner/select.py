"""Which template and tile configuration compiles a (spec, N, K, M bucket) for a device.

Rows M are served by buckets, each one compiled kernel whose M is symbolic: M <= 16 runs the small-M
kernel (one AMX block of M rows), larger M the blocked kernel.  A spec the fast template cannot run
falls back to the generic template, and the fallback is logged with its reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..codegen.cpu import amx
from ..codegen.cpu.generic import GenericConfig
from ..ops.matmul import Matmul

log = logging.getLogger("bitkern")

SMALL_M = amx.SMALL_M_ROWS
M_BUCKETS = ((1, SMALL_M), (SMALL_M + 1, 2**31 - 1))


def m_bucket(m: int) -> tuple[int, int]:
    """The bucket of rows M (1-based, inclusive bounds) whose kernel serves M."""
    if m < 1:
        raise ValueError(f"m={m}: a kernel serves at least one row")
    return next(bucket for bucket in M_BUCKETS if bucket[0] <= m <= bucket[1])


@dataclass(frozen=True)
class Choice:
    """A template, its configuration, and why it was chosen."""

    template: str
    config: object
    reason: str


def choose(spec: Matmul, n: int, k: int, bucket: tuple[int, int], layout: str, device) -> Choice:
    """The template and configuration for one kernel."""
    reason = _amx_unavailable(spec, k, layout, device)
    if reason is None:
        decode = amx.decode_strategies(spec)[0]
        if bucket[1] <= SMALL_M:
            config = amx.AmxConfig(n_tiles=2, prefetch=64, decode=decode)
        else:
            config = amx.AmxConfig(small_m=False, m_tiles=2, n_tiles=2, m_chunk=64, prefetch=64, decode=decode)
        return Choice("amx", config, "AMX bf16 with on-the-fly decode")
    log.info("bitkern: generic CPU template for %s (N=%d, K=%d): the AMX template does not run %s",
             spec.weight_dtype, n, k, reason)
    return Choice("generic", GenericConfig(), f"generic template: no AMX path for {reason}")


def _amx_unavailable(spec: Matmul, k: int, layout: str, device) -> str | None:
    if not device.has_amx_bf16:
        return "this CPU (no AMX-BF16)"
    if layout != "tile16":
        return f"the {layout} weight layout"
    return amx.unsupported_reason(spec, k)
