"""How well the CUDA cost model ranked the candidates a GPU kit run timed: for each tuned kernel of the run's
`tuning.json` (every shortlisted candidate built and timed on the GPU), the model's order of its candidates against
their measured order, reported per M bucket: Spearman's rank correlation, how often the model's first pick was the
fastest, and what the model's pick cost against the fastest (regret: its measured time over the best's).

A tuner that trusts the model alone (BITKERN_TUNING=model, or a cross-compiled kit without a GPU) gets the model's
pick; one that times its shortlist gets the best of the shortlist.  Either way the model's order decides what is
timed, so a bucket where it ranks badly is a bucket where a shortlist can miss the best configuration.

Run: python benchmarks/cuda_cost_rank.py [--tuning benchmarks/results/gpu_kit_h100/tuning.json] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

import numpy as np

DEFAULT_TUNING = Path(__file__).resolve().parent / "results" / "gpu_kit_h100" / "tuning.json"
BUCKET = re.compile(r"M=(\d+)\.\.(\d+)")
DESCRIPTION = re.compile(r"^(\S+) weights x (\S+) activations .* N=(\d+), K=(\d+)")


def ranks(values: list[float]) -> np.ndarray:
    """The ranks of `values` (0 = smallest), ties sharing their mean rank."""
    array = np.asarray(values, dtype=float)
    order = array.argsort(kind="stable")
    result = np.empty(len(array))
    result[order] = np.arange(len(array))
    for value in np.unique(array):
        tied = array == value
        result[tied] = result[tied].mean()
    return result


def spearman(modeled: list[float], measured: list[float]) -> float | None:
    """Spearman's rank correlation of two equally long lists (None where either is constant or too short)."""
    a, b = ranks(modeled), ranks(measured)
    if len(a) < 3 or a.std() == 0 or b.std() == 0:
        return None
    return float(np.corrcoef(a, b)[0, 1])


def kernel_ranking(trials: list[dict]) -> dict | None:
    """One tuned kernel's figures from its trials (those the run timed, with a modeled time), or None if fewer than
    two were timed."""
    timed = [t for t in trials if t.get("measured_s") is not None and t.get("modeled_s") is not None]
    if len(timed) < 2:
        return None
    modeled = [t["modeled_s"] for t in timed]
    measured = [t["measured_s"] for t in timed]
    pick = int(np.argmin(modeled))
    best = min(measured)
    model_order = list(np.argsort(modeled, kind="stable"))
    return {"candidates": len(timed), "rho": spearman(modeled, measured), "top1": measured[pick] == best,
            "regret": measured[pick] / best, "best_at": model_order.index(int(np.argmin(measured))) + 1,
            "templates": sorted({t["template"] for t in timed})}


def bucket_of(kernel: str) -> str:
    """The M bucket named in a tuned kernel's description ("1", "5-16", "129+")."""
    low, high = BUCKET.search(kernel).groups()
    return low if low == high else f"{low}+" if int(high) >= 2**31 - 1 else f"{low}-{high}"


def short_name(kernel: str) -> str:
    """"int4 x float16, N x K" of a tuned kernel's description (its whole text where it does not parse)."""
    found = DESCRIPTION.search(kernel)
    return kernel if found is None else "{} x {}, {}x{}".format(*found.groups())


def report(tuning: dict) -> str:
    """The results: a line per M bucket, then one per kernel."""
    rows, per_bucket = [], {}
    for entry in tuning["kernels"]:
        ranking = kernel_ranking(entry["record"]["trials"])
        if ranking is None:
            continue
        bucket = bucket_of(entry["kernel"])
        per_bucket.setdefault(bucket, []).append(ranking)
        rows.append((bucket, entry["kernel"], ranking))
    lines = ["| M | kernels | candidates timed (median) | Spearman rho (median, min) | model's pick the fastest | "
             "regret (median, max) | fastest at the model's rank (median, max) |", "|---|---|---|---|---|---|---|"]
    for bucket, rankings in sorted(per_bucket.items(), key=lambda item: int(item[0].split("-")[0].rstrip("+"))):
        rhos = [r["rho"] for r in rankings if r["rho"] is not None]
        regrets = [r["regret"] for r in rankings]
        at = [r["best_at"] for r in rankings]
        lines.append(f"| {bucket} | {len(rankings)} | {statistics.median(r['candidates'] for r in rankings):.0f} | "
                     f"{statistics.median(rhos):.2f}, {min(rhos):.2f} | "
                     f"{sum(r['top1'] for r in rankings)} of {len(rankings)} | "
                     f"{statistics.median(regrets):.2f}x, {max(regrets):.2f}x | "
                     f"{statistics.median(at):.0f}, {max(at)} |")
    lines += ["", "| M | kernel | templates | rho | regret | fastest at |", "|---|---|---|---|---|---|"]
    for bucket, kernel, r in rows:
        rho = "n/a" if r["rho"] is None else f"{r['rho']:.2f}"
        lines.append(f"| {bucket} | {short_name(kernel)} | {', '.join(r['templates'])} | {rho} | {r['regret']:.2f}x | "
                     f"{r['best_at']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tuning", default=str(DEFAULT_TUNING), help="a GPU kit run's tuning.json")
    parser.add_argument("--out", default=None, help="also write the results to this file")
    args = parser.parse_args()
    from provenance import header, publish

    tuning = json.loads(Path(args.tuning).read_text())
    text = (f"{header()}\n\nThe CUDA cost model's ranking of the candidates each kernel's tuning timed on "
            f"{tuning['device']} (`{args.tuning}`, the run's own modeled and measured times; regret: the measured "
            f"time of the model's first pick over the fastest's).\n\n{report(tuning)}\n")
    publish(text, args.out)


if __name__ == "__main__":
    main()
