"""The storage dtypes bitkern names (of activations, accumulators, outputs, scales, zeros): one table of each
one's torch dtype, TVM dtype and size, which every package reads instead of keeping its own copy."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DType:
    """A dtype by its bitkern name: the torch dtype, the TVM dtype and the bytes of one element."""

    name: str
    torch: torch.dtype
    tvm: str
    itemsize: int


DTYPES = {d.name: d for d in (
    DType("float32", torch.float32, "float32", 4),
    DType("float16", torch.float16, "float16", 2),
    DType("bfloat16", torch.bfloat16, "bfloat16", 2),
    DType("float8_e4m3", torch.float8_e4m3fn, "float8_e4m3fn", 1),
    DType("float8_e5m2", torch.float8_e5m2, "float8_e5m2", 1),
    DType("int8", torch.int8, "int8", 1),
    DType("uint8", torch.uint8, "uint8", 1),
    DType("int32", torch.int32, "int32", 4),
)}
_BY_TORCH = {d.torch: d.name for d in DTYPES.values()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a bitkern dtype name."""
    return DTYPES[name].torch


def tvm_dtype(name: str) -> str:
    """The TVM dtype of a bitkern dtype name."""
    return DTYPES[name].tvm


def itemsize(name: str) -> int:
    """Bytes of one element of a bitkern dtype name."""
    return DTYPES[name].itemsize


def dtype_name(dtype):
    """The bitkern name of a torch dtype or of a name; anything else is returned as it is (for the caller's
    check to name it)."""
    if isinstance(dtype, torch.dtype):
        return _BY_TORCH.get(dtype, dtype)
    return dtype
