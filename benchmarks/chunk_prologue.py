"""Per-chunk activation planes (AmxConfig.chunk_prologue) against one pass over all rows, same configuration
otherwise, timed alternately in one process (median of interleaved rounds): int4 4096x4096 at large M and
a ResNet 3x3 convolution.

Run: python benchmarks/chunk_prologue.py   (prints a table; run it on a quiet machine)
"""

from __future__ import annotations

import statistics
import time

import torch

import bitkern
from bitkern.codegen import build_kernel
from bitkern.codegen.cpu.amx import AmxConfig
from bitkern.ops import Conv2d, ConvGeometry, Matmul
from bitkern.tuner import host_cpu

LARGE_BUCKET = (129, 2**31 - 1)
ROUNDS = 10


def _pair(spec, n, k):
    """The two kernels that differ only in where the planes are built."""
    return {chunk: build_kernel(spec, n, k, "amx", AmxConfig(2, False, 128, 2, 64, "affine", chunk, m_tiles=2), "tile16",
                                LARGE_BUCKET, host_cpu()) for chunk in (False, True)}


def _interleaved(kernels, x, weight) -> dict:
    for kernel in kernels.values():
        kernel(x, weight)
    samples = {chunk: [] for chunk in kernels}
    for _ in range(ROUNDS):
        for chunk, kernel in kernels.items():
            start = time.perf_counter()
            kernel(x, weight)
            samples[chunk].append(time.perf_counter() - start)
    return {chunk: statistics.median(times) * 1e3 for chunk, times in samples.items()}


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    print("| case | one pass ms | per chunk ms | speed-up |\n|---|---|---|---|")
    quantized = bitkern.quantize(torch.randn(4096, 4096, generator=generator), "int4", group_size=128)
    kernels = _pair(Matmul.for_weight(quantized, "bfloat16"), 4096, 4096)
    for m in (256, 1024):
        x = torch.randn(m, 4096, generator=generator).bfloat16()
        ms = _interleaved(kernels, x, bitkern.pack(quantized))
        print(f"| int4 4096x4096 M={m} | {ms[False]:.2f} | {ms[True]:.2f} | {ms[False] / ms[True]:.2f}x |")
    geometry = ConvGeometry(256, 14, 14, (3, 3), padding=(1, 1, 1, 1))
    quantized = bitkern.quantize(torch.randn(256, geometry.reduction, generator=generator), "int4", group_size=64)
    kernels = _pair(Conv2d.for_weight(quantized, "bfloat16", geometry=geometry), 256, geometry.reduction)
    x = torch.randn(8, 14, 14, 256, generator=generator).bfloat16()
    ms = _interleaved(kernels, x, bitkern.pack(quantized))
    print(f"| conv 256x14x14 3x3, batch 8 | {ms[False]:.2f} | {ms[True]:.2f} | {ms[False] / ms[True]:.2f}x |")


if __name__ == "__main__":
    main()
