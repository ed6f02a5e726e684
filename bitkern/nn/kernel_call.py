"""What `bitkern.prepare` makes ready, as the modules that run kernels list it: a `KernelCall` per matmul kernel, with
the token counts and rows it runs at (its own module so that every layer type can list its calls without importing
`bitkern.nn.prepare`, which visits them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.matmul import Matmul
from ..tuner.buckets import M_BUCKETS, m_bucket

ALL_TOKENS = (1, 2**31 - 1)  # a KernelCall's token counts where any forward runs it


@dataclass(frozen=True)
class KernelCall:
    """One matmul kernel a module calls: its spec, the weight's N and K, the weight's layout and device; a forward
    over t tokens, for t within `tokens` (inclusive bounds), runs it at t·`rows_per_token` rows, or at any count of
    rows up to that where `up_to` (an expert's share of a prompt's rows)."""

    spec: Matmul
    n: int
    k: int
    layout: str
    device: torch.device
    tokens: tuple[int, int] = ALL_TOKENS
    rows_per_token: int = 1
    up_to: bool = False

    def rows(self, counts: tuple[int, ...]) -> list[int]:
        """One row count per M bucket that forwards over `counts` tokens run this kernel at."""
        rows = [t * self.rows_per_token for t in counts if self.tokens[0] <= t <= self.tokens[1]]
        if self.up_to and rows:
            rows = [low for low, _ in M_BUCKETS if low <= max(rows)]
        return list({m_bucket(m): m for m in rows}.values())
