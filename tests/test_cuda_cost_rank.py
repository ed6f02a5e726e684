"""benchmarks/cuda_cost_rank.py: Spearman's rank correlation as its textbook formula gives it (ties at their mean
rank), a kernel's regret and the rank of its fastest candidate, and the report of the committed H100 run, with a
line for every M bucket it tuned."""

import json
import random

from tests.helpers import benchmark


def test_spearman_matches_the_formula_without_ties_and_takes_ties_at_their_mean_rank():
    module = benchmark("cuda_cost_rank")
    generator = random.Random(0)
    for n in (3, 5, 8, 20):
        a = generator.sample(range(1000), n)
        b = generator.sample(range(1000), n)
        rank_a = {v: i for i, v in enumerate(sorted(a))}
        rank_b = {v: i for i, v in enumerate(sorted(b))}
        squared = sum((rank_a[x] - rank_b[y]) ** 2 for x, y in zip(a, b))
        assert abs(module.spearman(a, b) - (1 - 6 * squared / (n * (n * n - 1)))) < 1e-12
    assert list(module.ranks([3.0, 1.0, 3.0, 2.0])) == [2.5, 0.0, 2.5, 1.0]
    assert module.spearman([1, 1, 1], [1, 2, 3]) is None


def test_a_kernels_regret_and_the_rank_of_its_fastest_candidate():
    trials = [{"template": "gemv", "modeled_s": modeled, "measured_s": measured}
              for modeled, measured in ((1.0, 4.0), (2.0, 2.0), (3.0, 1.0), (4.0, None))]
    ranking = benchmark("cuda_cost_rank").kernel_ranking(trials)
    assert ranking["candidates"] == 3 and ranking["regret"] == 4.0 and not ranking["top1"]
    assert ranking["best_at"] == 3 and ranking["rho"] == -1.0


def test_the_report_of_the_h100_run_has_every_bucket_and_kernel():
    module = benchmark("cuda_cost_rank")
    tuning = json.loads(module.DEFAULT_TUNING.read_text())
    text = module.report(tuning)
    buckets = {line.split(" | ")[0][2:]: int(line.split(" | ")[1]) for line in text.splitlines()[2:]
               if line.startswith("| ") and line.split(" | ")[1].isdigit()}
    assert buckets == {"1": 20, "5-16": 5, "17-128": 5, "129+": 5}
    assert sum(buckets.values()) == len(tuning["kernels"])
