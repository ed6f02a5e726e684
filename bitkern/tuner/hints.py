"""Device hints (LADDER Algorithm 1, GetDeviceHint): the tile granularity each level prefers.

Each memory level and compute unit has an access granularity (a transaction, a vector, an instruction
shape); a tile that is a common multiple of all of them on every axis is accessed whole at every level.
The hint is that least common multiple, per axis (m rows of x, n output columns, k reduction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..ops.matmul import Matmul
from ..ttype import codes_per_word, effective_group_size, get, itemsize


@dataclass(frozen=True)
class Hint:
    """Preferred tile granularity on each axis, and where each requirement came from."""

    m: int
    n: int
    k: int
    sources: tuple[str, ...]


def device_hint(spec: Matmul, k: int, device) -> Hint:
    """The hint of `device` (a CPU or a CUDA architecture) for `spec` with reduction length k: per axis, the
    least common multiple of what each level of the device prefers."""
    levels = _cpu_levels(spec, k, device) if device.kind == "cpu" else _cuda_levels(spec, device)
    m, n, step = (math.lcm(*[level[axis] for level in levels.values() if level[axis]]) for axis in range(3))
    return Hint(m, n, step, tuple(f"{name}: m{v[0]} n{v[1]} k{v[2]}" for name, v in levels.items()))


def _cpu_levels(spec: Matmul, k: int, device) -> dict:
    """x86: 64-byte cache lines and vectors (16 lanes of one 32-bit word of codes for 16 rows), AMX tiles
    (16 rows x 16 columns of float32 C, 32-deep bf16 steps) or AVX512-BF16 dot products (16 columns, bf16
    pairs), the quantization group along k."""
    bits = get(spec.weight_dtype).bits
    group = effective_group_size(spec.group_size, k)
    lanes = device.vector_bytes // 4
    return {
        "cache line/vector": (1, lanes, codes_per_word(bits) if bits <= 32 else 1),
        "AMX tile": (16 if device.has_amx_bf16 else 1, 16 if device.has_amx_bf16 else 1,
                     32 if device.has_amx_bf16 else 1),
        "AVX512-BF16 dot": (1, lanes, 2) if "avx512_bf16" in device.flags else (1, 1, 1),
        "quantization group": (1, 1, math.gcd(group, 32 if device.has_amx_bf16 else group)),
    }


def _cuda_levels(spec: Matmul, device) -> dict:
    """NVIDIA: the mma instruction shape for the activation type, ldmatrix 8x8 fragments of 16-byte rows,
    32-byte global transactions (in codes of the weight type), 32 banks x 4 bytes of shared memory."""
    bits = get(spec.weight_dtype).bits
    mma = device.mma.get(spec.activation_dtype) or device.mma["float16"]
    activation_bytes = itemsize(spec.activation_dtype)
    return {
        "mma": (mma.m, mma.n, mma.k),
        "ldmatrix": (8, 8, device.ldmatrix_bytes // activation_bytes),
        "global transaction": (1, 1, device.global_transaction_bytes * 8 // bits),
        "shared banks": (1, 1, device.shared_banks * device.shared_bank_bytes // (2 * activation_bytes)),
    }
