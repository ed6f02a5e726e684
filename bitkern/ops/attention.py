"""Decode attention: one query row per head attending over a KV cache, the query heads of a KV head packed as its
group (grouped-query attention).  `DecodeAttention` is the spec a kernel is compiled for; `reference` is the
float64 definition every kernel is tested against.

Shapes (B batch, Hkv KV heads, G = query heads per KV head, L cache length, D head dimension):
query [B·Hkv, G, D], key and value [B·Hkv, L, D], mask [B, L] (mask "bool": True attends; "additive": added to
the scores), output [B·Hkv, G, D] in the query's dtype.  Query head h of a batch is row h // G, group h % G, as in
transformers' grouped-query attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ATTENTION_DTYPES = ("bfloat16", "float16", "float32")
MASK_KINDS = ("none", "bool", "additive")
LANES = 16  # head_dim is a whole number of 16-lane float32 vectors


@dataclass(frozen=True)
class DecodeAttention:
    """What one decode-attention kernel serves: the tensors' dtype, query heads per KV head, head dimension, and
    the kind of mask."""

    dtype: str
    groups: int
    head_dim: int
    mask: str = "none"

    def __post_init__(self):
        if self.dtype not in ATTENTION_DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; accepted: {list(ATTENTION_DTYPES)}")
        if not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"groups={self.groups!r} must be a positive int")
        if not isinstance(self.head_dim, int) or self.head_dim < LANES or self.head_dim % LANES:
            raise ValueError(f"head_dim={self.head_dim!r} must be a positive multiple of {LANES}")
        if self.mask not in MASK_KINDS:
            raise ValueError(f"mask={self.mask!r} is not supported; accepted: {list(MASK_KINDS)}")


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """softmax(scale · q·kᵀ (+ mask)) · v in float64, per row and group; shapes as in the module docstring."""
    scores = torch.einsum("rgd,rld->rgl", query.double(), key.double()) * scale
    if mask is not None:
        per_row = mask.repeat_interleave(query.shape[0] // mask.shape[0], dim=0)[:, None, :]
        scores = scores.masked_fill(~per_row, -math.inf) if mask.dtype == torch.bool else scores + per_row.double()
    return torch.einsum("rgl,rld->rgd", scores.softmax(-1), value.double()).to(query.dtype)
