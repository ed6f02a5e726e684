"""`python -m bitkern demo`: quantize a layer-sized weight with several types and report what it costs."""

from __future__ import annotations

import time

import torch

from .ops import Matmul
from .ttype import get, quantize

DEFAULT_TYPES = ("int8", "uint4", "int4", "nf4", "fp4_e2m1", "mxfp4", "nvfp4", "mxfp8", "uint3", "uint2")


def run(out_features: int = 4096, in_features: int = 4096, dtypes=DEFAULT_TYPES, group_size: int = 128,
        seed: int = 0, device: str | None = None) -> list[dict]:
    """Quantize one random [out, in] weight per type; return and print error, size and a matmul check."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.02).to(device)
    x = torch.randn(1, in_features, generator=generator).to(device)
    reference = x.double() @ weight.double().T
    fp16_bytes = weight.numel() * 2
    rows = []
    for name in dtypes:
        start = time.perf_counter()
        block_type = get(name).block_size > 1
        q = quantize(weight, name, group_size=None if block_type else group_size)
        seconds = time.perf_counter() - start
        y = Matmul.for_weight(q, "float32").reference(x, q)
        rows.append({
            "dtype": name, "group": q.group_size, "zero_mode": q.zero_mode,
            "bits_per_weight": 8 * q.nbytes / weight.numel(),
            "saved_vs_fp16": 1 - q.nbytes / fp16_bytes,
            "weight_rel_rms": float((q.dequantize() - weight).pow(2).mean().sqrt() / weight.pow(2).mean().sqrt()),
            "output_rel_err": float((y.double() - reference).norm() / reference.norm()),
            "quantize_s": seconds,
        })
    _print(rows, out_features, in_features, device)
    return rows


def _print(rows: list[dict], n: int, k: int, device: str) -> None:
    print(f"bitkern demo: weight [{n}, {k}] ~ N(0, 0.02²) on {device}; fp16 size {n * k * 2 / 2**20:.1f} MiB")
    print(f"{'dtype':<10}{'group':>6}{'zero':>6}{'bits/w':>8}{'saved':>8}{'weight err':>12}"
          f"{'y err (M=1)':>13}{'quantize':>10}")
    for r in rows:
        print(f"{r['dtype']:<10}{r['group']:>6}{r['zero_mode']:>6}{r['bits_per_weight']:>8.3f}"
              f"{r['saved_vs_fp16']:>8.1%}{r['weight_rel_rms']:>12.2e}{r['output_rel_err']:>13.2e}"
              f"{r['quantize_s']:>9.2f}s")
    print("weight err: relative RMS of dequantized vs float weight; y err: relative error of x·Wᵀ (reference "
          "matmul, float64) vs the float layer.")
