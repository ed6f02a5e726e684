"""CPU matmul: bitkern vs torch (fp32, bf16, int4 and int8 weight-only kernels), in one run.

Weights rotate through >= 1 GiB of copies so every call reads them from DRAM; results are reported as
GB/s of weight (+ scale) bytes and as a fraction of the DRAM read bandwidth measured in the same run.
Run: python -m pytest benchmarks/bench_cpu_matmul.py  (tables land in benchmarks/results/).
"""

from __future__ import annotations


import pytest
import torch

import bitkern
from bitkern.ops import Matmul

from conftest import measure, recorded, rotation

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]
ROWS = [1, 16, 128]
GROUP = 128
BITKERN_TYPES = ["int4", "nf4", "int8", "int2", "int1"]
PEERS = ["torch_fp32", "torch_bf16", "torch_int4", "torch_int8"]


def _bitkern_case(dtype: str, n: int, k: int, m: int):
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    quantized = bitkern.quantize(weight, dtype, group_size=GROUP)
    packed = bitkern.pack(quantized)
    spec = Matmul.for_weight(quantized, "bfloat16")
    x = torch.randn(m, k).bfloat16()

    def clone():
        return bitkern.PackedWeight(packed.layout, packed.ttype, packed.shape, packed.group_size, packed.zero_mode,
                                    packed.qweight.clone(), packed.scales.clone())

    next_weight = rotation(clone, packed.nbytes)
    return (lambda: spec(x, next_weight())), packed.nbytes


def _torch_case(method: str, n: int, k: int, m: int):
    x32 = torch.randn(m, k)
    if method == "torch_fp32":
        next_weight = rotation(lambda: torch.randn(n, k), n * k * 4)
        return (lambda: x32 @ next_weight().T), n * k * 4
    x = x32.bfloat16()
    if method == "torch_bf16":
        next_weight = rotation(lambda: torch.randn(n, k).bfloat16(), n * k * 2)
        return (lambda: x @ next_weight().T), n * k * 2
    if method == "torch_int4":
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
        scales_zeros = torch.rand(k // GROUP, n, 2).bfloat16()
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        nbytes = packed.numel() * packed.element_size() + scales_zeros.numel() * 2
        next_weight = rotation(lambda: (packed.clone(), scales_zeros.clone()), nbytes)

        def int4():
            w, sz = next_weight()
            return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, GROUP, sz)

        return int4, nbytes
    codes8 = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scales8 = torch.rand(n).bfloat16()
    next_weight = rotation(lambda: (codes8.clone(), scales8.clone()), n * k + n * 2)
    return (lambda: torch._weight_int8pack_mm(x, *next_weight())), n * k + n * 2


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("method", [f"bitkern_{t}" for t in BITKERN_TYPES] + PEERS)
def test_matmul(benchmark, record, dram_read_gbs, method, n, k, m):
    if method.startswith("bitkern_"):
        call, nbytes = _bitkern_case(method.removeprefix("bitkern_"), n, k, m)
    else:
        call, nbytes = _torch_case(method, n, k, m)
    seconds = measure(benchmark, call, rounds=(10, 400), warmup_rounds=2)
    gbs = nbytes / seconds / 1e9
    record("cpu_matmul", N=n, K=k, M=m, method=method, ms=seconds * 1e3, weight_MB=nbytes / 1e6, GBps=gbs,
           dram_fraction=gbs / dram_read_gbs)
    benchmark.extra_info.update(GBps=gbs, dram_fraction=gbs / dram_read_gbs, dram_read_GBps=dram_read_gbs)


def test_targets(record):
    """Issue targets, evaluated on this run's rows (reported, not asserted: benchmarks are not tests)."""
    rows = {(r["method"], r["N"], r["K"], r["M"]): r for r in recorded("cpu_matmul")}
    for n, k in SHAPES:
        def get(method, m):
            return rows.get((method, n, k, m))

        for dtype in ("int4", "nf4"):
            one, sixteen, int4_peer = get(f"bitkern_{dtype}", 1), get(f"bitkern_{dtype}", 16), get("torch_int4", 1)
            if one and int4_peer:
                record("cpu_matmul_targets", shape=f"{n}x{k}", target=f"{dtype} M=1 >= 85% DRAM",
                       value=one["dram_fraction"], met=one["dram_fraction"] >= 0.85)
                record("cpu_matmul_targets", shape=f"{n}x{k}", target=f"{dtype} M=1 >= 1.6x torch int4",
                       value=int4_peer["ms"] / one["ms"], met=int4_peer["ms"] / one["ms"] >= 1.6)
            if one and sixteen:
                record("cpu_matmul_targets", shape=f"{n}x{k}", target=f"{dtype} M=16 <= 1.5x M=1",
                       value=sixteen["ms"] / one["ms"], met=sixteen["ms"] / one["ms"] <= 1.5)
        mine, bf16 = get("bitkern_int4", 128), get("torch_bf16", 128)
        if mine and bf16:
            record("cpu_matmul_targets", shape=f"{n}x{k}", target="int4 M=128 at least as fast as torch bf16",
                   value=bf16["ms"] / mine["ms"], met=mine["ms"] <= bf16["ms"])
        base = get("bitkern_int4", 1)
        for dtype in ("int2", "int1"):
            low = get(f"bitkern_{dtype}", 1)
            if base and low:
                expected = low["weight_MB"] / base["weight_MB"]
                ratio = low["ms"] / base["ms"]
                record("cpu_matmul_targets", shape=f"{n}x{k}", target=f"{dtype}/int4 time within 15% of bytes",
                       value=ratio / expected, met=ratio <= 1.15 * expected)
