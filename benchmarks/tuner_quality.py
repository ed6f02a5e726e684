"""How good are the tuner's choices?  For a few (spec, shape, M bucket): time every enumerated candidate
(exhaustive search), compare the tuner's pick (top-k profiled) with the exhaustive best (its five fastest
and the pick re-timed, taking turns call by call), time the tuning itself, and report the Spearman rank
correlation of the cost model with the measured times.

Run: python benchmarks/tuner_quality.py [--quick]   (writes benchmarks/results/tuner_quality.md)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bitkern.ops import Matmul
from bitkern.tuner import host_cpu, tune
from bitkern.tuner.cost import estimate
from bitkern.tuner.profile import build_all, inputs, time_kernels
from bitkern.tuner.buckets import TUNED_M
from bitkern.tuner.space import enumerate_candidates
from provenance import header

CASES = [
    (Matmul("int4", "bfloat16"), 4096, 4096, (1, 1)),
    (Matmul("nf4", "bfloat16"), 11008, 4096, (5, 16)),
    (Matmul("int4", "bfloat16"), 4096, 11008, (17, 128)),
]
FINALISTS = 5  # the exhaustive search's fastest, timed again against the pick
RETIME_S = 0.35  # per finalist: single timings are noisy, and the exhaustive minimum of them is biased low


def built(results: list) -> list:
    """The kernels of `build_all`, raising the first build failure (every candidate is timed here)."""
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        result = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for position in range(i, j + 1):
                result[order[position]] = (i + j) / 2
            i = j + 1
        return result

    ra, rb = torch.tensor(ranks(a)), torch.tensor(ranks(b))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def evaluate(spec, n, k, bucket, quick: bool) -> dict:
    device = host_cpu()
    m = TUNED_M[bucket]
    _, candidates = enumerate_candidates(spec, n, k, bucket, "tile16", device)
    if quick:
        candidates = candidates[::4]
    modeled = [estimate(c.template, c.config, spec, n, k, m, device).seconds for c in candidates]
    x, copies, bias = inputs(spec, n, k, m, "tile16", device)
    measured = []
    for start in range(0, len(candidates), 8):
        kernels = built(build_all(candidates[start:start + 8], spec, n, k, "tile16", bucket, device))
        measured += time_kernels(kernels, x, copies, bias)
    began = time.perf_counter()
    tuned = tune(spec, n, k, bucket, "tile16", device)
    tuning_seconds = time.perf_counter() - began
    pick = tuned.record.choice
    finalists = sorted(range(len(candidates)), key=measured.__getitem__)[:FINALISTS]
    finalist_kernels = build_all([candidates[i] for i in finalists], spec, n, k, "tile16", bucket, device)
    kernels = [tuned.kernel] + built(finalist_kernels)
    retimed = time_kernels(kernels, x, copies, bias, budget_s=RETIME_S)
    best = min(range(len(finalists)), key=lambda i: retimed[i + 1])
    return {"case": f"{spec.weight_dtype} {n}x{k} M={bucket[0]}..{bucket[1]} (tuned at {m})",
            "candidates": len(candidates), "spearman": spearman(modeled, measured),
            "best_ms": retimed[best + 1] * 1e3, "pick_ms": retimed[0] * 1e3,
            "pick/best": retimed[0] / retimed[best + 1],
            "tuning_s": tuning_seconds, "pick": f"{pick.template} {pick.config}",
            "best": f"{candidates[finalists[best]].template} {candidates[finalists[best]].config}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="every 4th candidate only")
    args = parser.parse_args()
    rows = [evaluate(*case, args.quick) for case in CASES]
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row.values()) + " |")
    text = "\n".join(lines)
    print(text)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "tuner_quality.md").write_text(f"{header()}\n\n{text}\n\nthreads: {torch.get_num_threads()}\n")


if __name__ == "__main__":
    main()
