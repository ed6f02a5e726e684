"""Decode-attention kernels (`ops.attention.DecodeAttention`) for this process's CPU: compiled on first use (one
build of ~0.5 s per dtype, group size, head dimension and mask kind), kept for the process."""

from __future__ import annotations

import functools
import importlib.util

from ..ops.attention import DecodeAttention
from .lookup import KernelNotFound


CAN_BUILD = importlib.util.find_spec("tvm") is not None  # this process can compile the kernels


@functools.lru_cache(maxsize=None)
def attention_kernel(spec: DecodeAttention):
    """The compiled kernel of `spec` for this CPU; KernelNotFound where this process cannot compile (no TVM)."""
    if not CAN_BUILD:
        raise KernelNotFound(f"no decode-attention kernel for {spec}: TVM (apache-tvm) is not installed")
    from ..codegen.cpu.attention import build
    from ..tuner.device import host_cpu

    return build(spec, host_cpu())
