"""Decode attention (one query row per head over a KV cache, query heads grouped per KV head) on bitkern's CPU
kernel: `decode_attention`, with the shapes of `bitkern.ops.attention`, and the same as the custom op
`torch.ops.bitkern.decode_attention` for torch.compile.  At a decode step's size the kernel takes ~10-15 µs where
torch's SDPA takes ~30-100 µs (its setup outweighs the work), once per layer and step."""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..cache.attention import attention_kernel
from ..ops.attention import ATTENTION_DTYPES, LANES, DecodeAttention
from ..ttype.dtypes import torch_dtype
from .dispatcher import op

_DTYPES = {torch_dtype(name): name for name in ATTENTION_DTYPES}
KERNEL_DTYPES = tuple(_DTYPES)  # the torch dtypes the kernel takes


def decode_attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None,
                     scale: float | None = None) -> Tensor:
    """softmax(scale·q·kᵀ (+ mask))·v: query [R, G, D] (R = batch × KV heads), key and value [R, L, D], mask None,
    bool [B, L] (True attends) or float [B, L] (added to the scores) with R a multiple of B; scale default
    D^-0.5.  Returns [R, G, D] in the query's dtype.  CPU tensors of one dtype: bfloat16, float16 or float32."""
    if not all(isinstance(t, Tensor) for t in (query, key, value)) or not (mask is None or isinstance(mask, Tensor)):
        raise TypeError(f"query, key, value (and mask, unless None) must be tensors, got "
                        f"{[type(t).__name__ for t in (query, key, value, mask)]}")
    kernel = _kernel((query.shape, query.dtype, query.device), (key.shape, key.dtype, key.device),
                     (value.shape, value.dtype, value.device), None if mask is None else (mask.shape, mask.dtype))
    rows, groups, dim = query.shape
    length = key.shape[1]
    mask_argument = () if mask is None else (mask.contiguous().view(torch.uint8) if mask.dtype == torch.bool
                                              else mask.to(torch.float32).contiguous(),)
    scratch = torch.empty(rows, groups, -(-length // LANES) * LANES, dtype=torch.float32)
    out = torch.empty(rows, groups, dim, dtype=query.dtype)
    kernel(query.contiguous(), key.contiguous(), value.contiguous(), *mask_argument,
           _scale(dim ** -0.5 if scale is None else float(scale)), scratch, out)
    return out


@op("decode_attention")
def decode_attention_op(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], scale: float) -> Tensor:
    """`decode_attention` as a torch custom op (torch.compile calls it as one opaque node)."""
    return decode_attention(query, key, value, mask, scale)


@decode_attention_op.register_fake
def _decode_attention_fake(query, key, value, mask, scale):
    return query.new_empty(query.shape)


@functools.lru_cache(maxsize=64)
def _scale(scale: float) -> Tensor:
    """The scale as the kernel takes it: a float32 tensor of one element (made once per value)."""
    with torch.inference_mode(False):
        return torch.tensor([scale], dtype=torch.float32)


@functools.lru_cache(maxsize=256)  # a dynamic cache's every length is a signature: the oldest are dropped
def _kernel(query: tuple, key: tuple, value: tuple, mask: tuple | None):
    """The kernel for tensors of these (shape, dtype, device) signatures, checked once per signature."""
    for name, (shape, dtype, device) in (("query", query), ("key", key), ("value", value)):
        if len(shape) != 3 or device.type != "cpu":
            raise ValueError(f"{name} must be a 3-D CPU tensor, got {tuple(shape)} on {device}")
        if dtype != query[1] or dtype not in _DTYPES:
            raise ValueError(f"{name}.dtype={dtype} must be the query's and one of {list(ATTENTION_DTYPES)}")
    (rows, groups, dim), (key_shape, value_shape) = query[0], (key[0], value[0])
    if key_shape != value_shape or key_shape[0] != rows or key_shape[2] != dim or key_shape[1] < 1:
        raise ValueError(f"key and value must be [{rows}, L, {dim}] (L >= 1) for query {tuple(query[0])}, got "
                         f"{tuple(key_shape)} and {tuple(value_shape)}")
    if mask is not None and (len(mask[0]) != 2 or mask[0][1] != key_shape[1] or rows % mask[0][0]
                             or not (mask[1] == torch.bool or mask[1].is_floating_point)):
        raise ValueError(f"mask must be None or a bool or float [B, {key_shape[1]}] tensor with {rows} a multiple of "
                         f"B, got {tuple(mask[0])} {mask[1]}")
    kind = "none" if mask is None else "bool" if mask[1] == torch.bool else "additive"
    return attention_kernel(DecodeAttention(_DTYPES[query[1]], groups, dim, kind))
