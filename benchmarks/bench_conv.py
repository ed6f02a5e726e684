"""ResNet 3x3 convolutions: bitkern.Conv2d (implicit GEMM) vs torch's float convolutions and vs im2col, one run.

Layers of ResNet-50's stages (C -> C channels, 3x3, padding 1) at batch 1 and 8.  torch runs fp32 on NCHW
input and bf16 on channels-last input (oneDNN's AMX path); bitkern runs int4 / nf4 / int8 weights with
bf16 channels-last input (its kernel reads NHWC directly), and, to show what the gather saves, the same
int4 GEMM kernel on an im2col matrix made by torch (`bitkern.ops.conv.im2col`: unfold, then the GEMM).
The weights are small (KBs to a few MBs) and stay in cache: these layers are compute-bound.
Tables: `conv` (median ms, GFLOP/s) and `conv_speedup` (vs torch fp32 / bf16 / im2col; above 1: faster).
Run it on a quiet machine: with any other process busy on one of the 2 cores, torch's OpenMP convolutions
wait at every barrier (measured: 16 ms instead of 0.2-1 ms for torch alone, no bitkern in the process).
Run: python -m pytest benchmarks/bench_conv.py  (tables land in benchmarks/results/).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import bitkern
from bitkern.ops.conv import im2col

from conftest import measure, recorded

LAYERS = ((64, 56), (128, 28), (256, 14), (512, 7))
BATCHES = (1, 8)
QUANTIZED = ("int4", "nf4", "int8")
METHODS = ("torch_fp32", "torch_bf16", *(f"bitkern_{name}" for name in QUANTIZED), "im2col_int4")


def _case(method: str, channels: int, size: int, batch: int):
    generator = torch.Generator().manual_seed(0)
    source = torch.nn.Conv2d(channels, channels, 3, padding=1, bias=False).requires_grad_(False)
    source.weight.normal_(0, 0.02, generator=generator)
    x = torch.randn(batch, channels, size, size, generator=generator)
    if method == "torch_fp32":
        return lambda: F.conv2d(x, source.weight, padding=1)
    x = x.bfloat16().contiguous(memory_format=torch.channels_last)
    if method == "torch_bf16":
        weight = source.weight.bfloat16().contiguous(memory_format=torch.channels_last)
        return lambda: F.conv2d(x, weight, padding=1)
    layer = bitkern.Conv2d.from_float(source, method.rsplit("_", 1)[1], group_size=64)
    if method.startswith("bitkern_"):
        return lambda: layer(x)
    weight, spec = layer.packed_weight(), bitkern.ops.Matmul("int4", "bfloat16", group_size=64)
    geometry = bitkern.ops.ConvGeometry(channels, size, size, (3, 3), padding=(1, 1, 1, 1))
    image = x.permute(0, 2, 3, 1)
    return lambda: spec(im2col(image, geometry), weight)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("channels, size", LAYERS)
@pytest.mark.parametrize("method", METHODS)
def test_conv(benchmark, record, method, channels, size, batch):
    call = _case(method, channels, size, batch)
    with torch.no_grad():
        seconds = measure(benchmark, call, rounds=(10, 400), warmup_rounds=2)
    flops = 2 * batch * size * size * channels * channels * 9
    record("conv", layer=f"{channels}x{size}x{size}", batch=batch, method=method, ms=seconds * 1e3,
           GFLOPs=flops / seconds / 1e9)


def test_speedups(record):
    """bitkern's speed-up over torch and over im2col, from this run's rows (reported, not asserted)."""
    rows = {(r["method"], r["layer"], r["batch"]): r["ms"] for r in recorded("conv")}
    for channels, size in LAYERS:
        layer = f"{channels}x{size}x{size}"
        for batch in BATCHES:
            base = {m: rows.get((m, layer, batch)) for m in ("torch_fp32", "torch_bf16", "im2col_int4")}
            for name in QUANTIZED:
                mine = rows.get((f"bitkern_{name}", layer, batch))
                if mine and all(base.values()):
                    record("conv_speedup", layer=layer, batch=batch, method=f"bitkern_{name}", ms=mine,
                           vs_fp32=base["torch_fp32"] / mine, vs_bf16=base["torch_bf16"] / mine,
                           vs_im2col=base["im2col_int4"] / mine)
