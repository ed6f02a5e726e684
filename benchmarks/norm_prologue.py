"""What a folded norm adds to a bitkern kernel: one int4 g128 bf16 layer called with and without an RMSNorm in its
activation prologue (`bitkern.fusion.modules.fused_call` with a `FoldedNorm`, Hugging Face LlamaRMSNorm semantics),
the two calls alternating per round, medians of their times and of the per-round differences.

Run: python benchmarks/norm_prologue.py [--n 3072] [--k 2048] [--rows 1 16 128] [--rounds 40]
(the first run builds and tunes the kernels; report the load: `uptime`)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    import bitkern
    from bitkern.fusion.modules import FoldedNorm, fused_call

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3072)
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--rounds", type=int, default=40)
    arguments = parser.parse_args()
    torch.manual_seed(0)
    n, k = arguments.n, arguments.k
    layer = bitkern.quantize_model(torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)).to(torch.bfloat16), "int4",
                                   group_size=128, compute_dtype=torch.bfloat16)[0]
    weight = torch.nn.Parameter(1 + 0.1 * torch.randn(k, dtype=torch.bfloat16), requires_grad=False)
    norm = FoldedNorm("rmsnorm", weight, None, 1e-6)
    print(f"load: {os.getloadavg()}, threads: {torch.get_num_threads()}, int4 g128 [{n}, {k}], bf16")
    for m in arguments.rows:
        x = torch.randn(m, k, dtype=torch.bfloat16)
        calls = {"plain": lambda: fused_call(layer, x), "norm": lambda: fused_call(layer, x, norm=norm)}
        times = {name: [] for name in calls}
        with torch.inference_mode():
            for call in calls.values():
                call(), call()
            for _ in range(arguments.rounds):
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    times[name].append(time.perf_counter() - start)
        added = statistics.median(b - a for a, b in zip(times["plain"], times["norm"]))
        print(f"M={m}: plain {1e6 * statistics.median(times['plain']):.0f} us, with the norm "
              f"{1e6 * statistics.median(times['norm']):.0f} us, added {1e6 * added:+.0f} us")


if __name__ == "__main__":
    main()
