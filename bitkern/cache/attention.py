"""Decode-attention kernels (`ops.attention.DecodeAttention`) for this process's CPU: compiled on first use (one
build of ~0.5 s per dtype, group size, head dimension and mask kind), kept for the process."""

from __future__ import annotations

import threading

from ..ops.attention import DecodeAttention
from .lookup import KernelNotFound, missing_compiler


CAN_BUILD = missing_compiler() is None  # this process can compile the kernels
_kernels: dict = {}
_build_lock = threading.Lock()


def attention_kernel(spec: DecodeAttention):
    """The compiled kernel of `spec` for this CPU; KernelNotFound where this process cannot compile (no TVM
    compiler)."""
    kernel = _kernels.get(spec)
    return kernel if kernel is not None else _build(spec)[0]


def prepare_attention(spec: DecodeAttention) -> str:
    """Make the kernel of `spec` ready ahead of its first call; "ready" (this process had it) or "built"."""
    return "ready" if spec in _kernels else _build(spec)[1]


def _build(spec: DecodeAttention):
    with _build_lock:
        if spec in _kernels:
            return _kernels[spec], "ready"
        if not CAN_BUILD:
            raise KernelNotFound(f"no decode-attention kernel for {spec}: {missing_compiler()} not found")
        from ..codegen.cpu.attention import build
        from ..tuner.device import host_cpu

        kernel = _kernels[spec] = build(spec, host_cpu())
    return kernel, "built"
