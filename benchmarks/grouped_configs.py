"""The grouped kernels' configurations timed one against another at a mixture-of-experts decode step's shapes: for
each projection (the top-8 gate/up of one token, 1536x2048; the top-1 down of its 8 pairs, 2048x768; 64 experts, int4
g128, bf16 activations) every listed configuration of the grouped VNNI (int8 activations) or grouped FMA template,
built as it is (no tuning), called in turn round by round (the order reversed every other round), each call on one
of four stacks of experts (600 MB in all: each call reads its experts from DRAM) with a fresh routing; medians of
the rounds' medians, and the GB/s of the selected experts' bytes against the DRAM probe (the best of a probe before
every round and after the last).  What the tuner's
cost model ranks (tiles a task, prefetch, in turn) is checked against this.

Run: python benchmarks/grouped_configs.py [--template grouped_vnni|grouped_fma] [--rounds 9] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import bitkern
from bitkern.codegen import build_kernel, pack
from bitkern.codegen.cpu.fma import FmaConfig
from bitkern.codegen.cpu.vnni import VnniConfig
from bitkern.ops import GroupedMatmul
from bitkern.tuner import host_cpu
from conftest import best_read_gbs, read_probes
from provenance import header, publish

EXPERTS, STACKS, CALLS = 64, 4, 16
# (name, n, k, rows, top_k): the projections of one decode step of hidden 2048, experts of 768, top-8
PROJECTIONS = [("gate/up, top-8 of 1 token", 1536, 2048, 1, 8), ("down, top-1 of 8 pairs", 2048, 768, 8, 1)]
CONFIGS = {"grouped_vnni": [VnniConfig(1, prefetch=128), VnniConfig(1, prefetch=0), VnniConfig(2, prefetch=32),
                            VnniConfig(4, prefetch=0), VnniConfig(4, prefetch=32), VnniConfig(4, prefetch=64),
                            VnniConfig(6, prefetch=32), VnniConfig(4, prefetch=128, in_turn=True),
                            VnniConfig(2, prefetch=128, in_turn=True)],
           "grouped_fma": [FmaConfig(1, 0), FmaConfig(1, 32), FmaConfig(2, 32), FmaConfig(4, 0), FmaConfig(4, 32),
                           FmaConfig(4, 64)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--template", choices=list(CONFIGS), default="grouped_vnni")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--out", default=None, help="also write the results to this file")
    args = parser.parse_args()
    torch.manual_seed(0)
    cpu = host_cpu()
    activation_quant = "int8" if args.template == "grouped_vnni" else "none"
    probes, probe_bytes = read_probes()
    load_before = os.getloadavg()[0]
    lines = [header(), "", f"{args.template} on {cpu.level.name}, {cpu.cores} threads, {args.rounds} interleaved "
             f"rounds of {CALLS} calls"]
    for name, n, k, rows, top_k in PROJECTIONS:
        spec = GroupedMatmul("int4", "bfloat16", group_size=128, experts=EXPERTS, top_k=top_k,
                             activation_quant=activation_quant)
        stacks = [pack(bitkern.quantize(torch.randn(EXPERTS * n, k), "int4", group_size=128)) for _ in range(STACKS)]
        kernels = {config: build_kernel(spec, n, k, args.template, config, "tile16", (rows, rows), cpu)
                   for config in CONFIGS[args.template]}
        x = torch.randn(rows, k).bfloat16()
        samples = {config: [] for config in kernels}
        distinct = []  # experts each call selected
        read_gbs = 0.0
        for round_index in range(args.rounds):
            read_gbs = max(read_gbs, best_read_gbs(probes, probe_bytes, reads=2))
            order = list(kernels.items())
            for config, kernel in order if round_index % 2 else order[::-1]:
                times = []
                for call in range(CALLS):
                    indices = torch.stack([torch.randperm(EXPERTS)[:top_k] for _ in range(rows)])
                    distinct.append(len(indices.unique()))
                    start = time.perf_counter()
                    kernel(x, stacks[call % STACKS], None, indices=indices)
                    times.append(time.perf_counter() - start)
                samples[config].append(statistics.median(times))
        read_gbs = max(read_gbs, best_read_gbs(probes, probe_bytes, reads=2))
        selected = statistics.mean(distinct)
        expert_bytes = stacks[0].qweight.nbytes / EXPERTS + stacks[0].scales.nbytes / EXPERTS
        lines += ["", f"{name} ({n}x{k}): {selected:.2f} experts a call on average, "
                  f"{selected * expert_bytes / 1e6:.1f} MB; DRAM probe {read_gbs:.1f} GB/s", "",
                  "| n_tiles | prefetch | in_turn | median ms | GB/s | of the probe |", "|---|---|---|---|---|---|"]
        for config, values in samples.items():
            median = statistics.median(values)
            gbs = selected * expert_bytes / median / 1e9
            lines.append(f"| {config.n_tiles} | {config.prefetch} | {getattr(config, 'in_turn', False)} | "
                         f"{median * 1e3:.3f} | {gbs:.1f} | {gbs / read_gbs:.2f} |")
    lines += ["", f"1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after"]
    publish("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
