"""bitkern's CPU kernels at one instruction-set level against the machine's DRAM limit and torch, in one run.

For each weight type and shape the tuner picks (by timing) the kernel for rows M at the level given, the way a
process with BITKERN_CPU_LEVEL set would; weights rotate through >= 1 GiB of copies so every call reads them from
DRAM.  Cases take turns round by round with the DRAM probes (torch.sum and a streaming TVM reader) and torch's bf16
matmul; each figure is a median over rounds, each ratio the median of per-round ratios.  On a CPU above the level
(an AVX-512 machine measuring its AVX2 kernels) the figures are those of the lower level's code on this CPU.

Run: python benchmarks/cpu_levels.py --level x86-64-v3 [--rows 1] [--activation-quant int8] [--types int4 nf4 ...]
     [--shapes 4096x4096 14336x4096 4096x14336] [--out benchmarks/results/cpu_levels_x86-64-v3.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("BITKERN_TUNING", "profile")

import bitkern  # noqa: E402
from bitkern.cache import kernel_for  # noqa: E402
from bitkern.ops import Matmul  # noqa: E402
from bitkern.tuner import host_cpu  # noqa: E402
from conftest import interleaved, read_probes, rotation, round_ratio  # noqa: E402

GROUPS = {"mxfp4": 32}  # block-scaled types have their own block; the others use --group


def _case(dtype: str, n: int, k: int, m: int, group: int, activation_quant: str, device):
    """(call, weight bytes per call, template chosen) of a bitkern kernel with rotating weights."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02
    quantized = bitkern.quantize(weight, dtype, group_size=GROUPS.get(dtype, group))
    packed = bitkern.pack(quantized)
    spec = Matmul.for_weight(quantized, "bfloat16", activation_quant=activation_quant)
    kernel = kernel_for(spec, n, k, m, packed.layout, device)
    next_weight = rotation(lambda: packed.from_format(packed.format, *(None if t is None else t.clone()
                                                                       for t in packed.tensors())), packed.nbytes)
    x = torch.randn(m, k).bfloat16()
    return (lambda: kernel(x, next_weight())), packed.nbytes, kernel.template


def _torch_bf16(n: int, k: int, m: int):
    next_weight = rotation(lambda: torch.randn(n, k).bfloat16(), n * k * 2)
    x = torch.randn(m, k).bfloat16()
    return lambda: x @ next_weight().T


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--level", default=None, help="an instruction-set level (default: the host's)")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--types", nargs="+", default=["int4", "nf4", "int8", "mxfp4", "int2"])
    parser.add_argument("--shapes", nargs="+", default=["4096x4096", "14336x4096", "4096x14336"])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--activation-quant", default="none", help="none (bf16 activations) or int8 (W4A8, W8A8)")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()

    device = host_cpu() if args.level is None else host_cpu().at_level(args.level)
    if not device.runs_here():
        parser.error(f"--level {args.level}: this CPU cannot run it")
    probes, probe_bytes = read_probes()
    lines = [f"# bitkern CPU kernels at {device.level.name}, M={args.rows}, activation_quant={args.activation_quant}",
             "",
             f"{host_cpu().name} ({platform.machine()}, host level {host_cpu().level.name}), {device.cores} threads, "
             f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; command: `python benchmarks/cpu_levels.py "
             f"{' '.join(sys.argv[1:])}`",
             "",
             "| type | N x K | kernel | ms | GB/s | of DRAM probe | torch bf16 ms | torch bf16 / bitkern |",
             "|---|---|---|---|---|---|---|---|"]
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        torch_call = _torch_bf16(n, k, args.rows)
        for dtype in args.types:
            call, nbytes, template = _case(dtype, n, k, args.rows, args.group, args.activation_quant, device)
            calls = {"bitkern": call, "torch": torch_call, **{f"probe {name}": probe for name, probe in probes.items()}}
            times = interleaved(calls, rounds=args.rounds)
            probe_s = [min(values) for values in zip(*(times[f"probe {name}"] for name in probes))]
            fraction = statistics.median((nbytes / b) / (probe_bytes / p) for p, b in zip(probe_s, times["bitkern"]))
            ms = statistics.median(times["bitkern"]) * 1e3
            lines.append(f"| {dtype} | {n}x{k} | {template} | {ms:.3f} | {nbytes / ms / 1e6:.1f} | {fraction:.2f} | "
                         f"{statistics.median(times['torch']) * 1e3:.3f} | "
                         f"{round_ratio(times['torch'], times['bitkern']):.2f} |")
            print(lines[-1], flush=True)
    probe_gbs = probe_bytes / min(min(times[f"probe {name}"]) for name in probes) / 1e9
    lines += ["", f"DRAM probe (last case's best round): {probe_gbs:.1f} GB/s; `of DRAM probe` is the median over "
                  f"rounds of (weight bytes / kernel time) / (probe bytes / probe time) in the same round."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as out:
            out.write(text)


if __name__ == "__main__":
    main()
