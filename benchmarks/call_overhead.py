"""What the public call adds to the compiled kernel at M=1: `spec(x, w)` against the kernel object `kernel(x, w)`,
called alternately with weights rotated through 1 GiB of copies (so each call follows a DRAM-streaming one,
as in the matmul benchmark), 10th percentile and median in µs.

Run: python benchmarks/call_overhead.py   (run it on a quiet machine)
"""

from __future__ import annotations

import statistics
import time

import torch

import bitkern
from bitkern.cache import kernel_for
from bitkern.ops import Matmul

ROUNDS = 300


def main() -> None:
    print("| type | N x K | kernel p10 µs | spec p10 µs | added p10 µs | added median µs |\n|---|---|---|---|---|---|")
    for name in ("int4", "int1"):
        quantized = bitkern.quantize(torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)) * 0.02,
                                     name, group_size=128)
        packed = bitkern.pack(quantized)
        copies = [bitkern.PackedWeight(packed.layout, packed.ttype, packed.shape, packed.group_size, packed.zero_mode,
                                       packed.qweight.clone(), packed.scales.clone())
                  for _ in range(max(2, (1 << 30) // packed.nbytes))]
        spec = Matmul.for_weight(quantized, "bfloat16")
        x = torch.randn(1, 4096).bfloat16()
        spec(x, packed)
        kernel = kernel_for(spec, 4096, 4096, 1, packed.layout)
        calls = {"kernel": lambda w: kernel(x, w), "spec": lambda w: spec(x, w)}
        samples = {label: [] for label in calls}
        for i in range(ROUNDS):
            for j, (label, call) in enumerate(calls.items()):
                weight = copies[(2 * i + j) % len(copies)]
                start = time.perf_counter()
                call(weight)
                samples[label].append((time.perf_counter() - start) * 1e6)
        p10 = {label: sorted(v)[len(v) // 10] for label, v in samples.items()}
        median = {label: statistics.median(v) for label, v in samples.items()}
        print(f"| {name} | 4096x4096 | {p10['kernel']:.1f} | {p10['spec']:.1f} | {p10['spec'] - p10['kernel']:.1f} | "
              f"{median['spec'] - median['kernel']:.1f} |")


if __name__ == "__main__":
    main()
