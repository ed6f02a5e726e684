"""One mixture-of-experts layer's decode step on CPU: the grouped kernels (one call per projection, each selected
expert's weights read once), with float activations (the grouped FMA template) and with int8 ones
(activation_quant="int8": the grouped VNNI template), each with SwiGLU and the weighted top-k sum in the kernels'
output stage (what `bitkern.Experts` runs) and in torch between and after the calls, against the per-expert path (one
dense kernel call per selected expert and projection), all through `bitkern.Experts`, called in turn round by round,
the order rotating (each call a fresh top-k routing of one token: calls sharing one would find the previous call's
experts in a last-level cache as large as Zen 3's 32 MB), medians and the ratios, each as a fraction of the DRAM limit
(the selected experts' bytes at the read bandwidth probed every tenth round, best of the run), with the load average
during the run.

The layer: hidden 2048, 64 experts of size 768, top-8, int4 with groups of 128 (Qwen3-MoE's shape family: 150 MB of
experts, far beyond the last-level cache, so each step reads its 8 experts' 19.5 MB from DRAM).

Run: python benchmarks/moe_decode.py [--threads 2] [--rounds 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import bitkern
from bitkern.nn import experts as experts_module
from conftest import best_read_gbs, read_probes

HIDDEN, EXPERTS, SIZE, TOP_K = 2048, 64, 768, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layer = bitkern.Experts(EXPERTS, HIDDEN, SIZE, dtype="int4", group_size=128)
    int8_layer = bitkern.Experts(EXPERTS, HIDDEN, SIZE, dtype="int4", group_size=128, activation_quant="int8")
    x = torch.randn(1, HIDDEN)
    def per_expert(index, weights):
        experts_module.GROUPED_PAIRS = 0
        try:
            return layer(x, index, weights)
        finally:
            experts_module.GROUPED_PAIRS = grouped_pairs

    def in_torch(module):
        """The module's decode with its gate and weighted sum in torch (as before they ran in the kernels)."""
        def call(index, weights):
            module._fusions = lambda *_: (False, False)
            try:
                return module(x, index, weights)
            finally:
                del module._fusions
        return call

    grouped_pairs = experts_module.GROUPED_PAIRS
    calls = {"grouped": lambda index, weights: layer(x, index, weights),
             "grouped, gate and sum in torch": in_torch(layer),
             "grouped, int8 activations": lambda index, weights: int8_layer(x, index, weights),
             "grouped, int8 activations, gate and sum in torch": in_torch(int8_layer),
             "per-expert": per_expert}
    routings = [torch.rand(1, EXPERTS).topk(TOP_K, dim=-1) for _ in range(args.rounds * len(calls))]
    with torch.inference_mode():
        for call in calls.values():  # tune and build both paths' kernels, then warm up
            for weights, index in routings[:5]:
                call(index, torch.softmax(weights, -1))
        samples = {label: [] for label in calls}
        probes, probe_bytes = read_probes()
        read_gbs = 0.0
        load_before = os.getloadavg()[0]
        for round_index in range(args.rounds):
            if round_index % 10 == 0:
                read_gbs = max(read_gbs, best_read_gbs(probes, probe_bytes, reads=2))
            order = list(calls.items())
            for turn, (label, call) in enumerate(order[round_index % len(order):] + order[:round_index % len(order)]):
                weights, index = routings[round_index * len(calls) + turn]
                weights = torch.softmax(weights, -1)
                start = time.perf_counter()
                call(index, weights)
                samples[label].append(time.perf_counter() - start)
        load_after = os.getloadavg()[0]
    median = {label: statistics.median(values) * 1e6 for label, values in samples.items()}
    dram_us = TOP_K * layer.nbytes / EXPERTS / read_gbs / 1e3
    print(f"{args.threads} threads, {args.rounds} interleaved rounds, 1-minute load average {load_before:.2f} before, "
          f"{load_after:.2f} after")
    print(f"DRAM probe {read_gbs:.1f} GB/s: the {TOP_K} experts' {TOP_K * layer.nbytes / EXPERTS / 1e6:.1f} MB take "
          f"{dram_us:.0f} µs")
    print("| path | median µs | p10 µs | DRAM fraction (median) |\n|---|---|---|---|")
    for label, values in samples.items():
        print(f"| {label} | {median[label]:.0f} | {sorted(values)[len(values) // 10] * 1e6:.0f} | "
              f"{dram_us / median[label]:.2f} |")
    fused = median["grouped"] / median["grouped, gate and sum in torch"]
    fused_int8 = median["grouped, int8 activations"] / median["grouped, int8 activations, gate and sum in torch"]
    print(f"grouped / per-expert (medians): {median['grouped'] / median['per-expert']:.3f}; grouped with int8 "
          f"activations / grouped: {median['grouped, int8 activations'] / median['grouped']:.3f}; output stage in "
          f"the kernels / in torch: {fused:.3f} (float activations), {fused_int8:.3f} (int8)")

if __name__ == "__main__":
    main()
