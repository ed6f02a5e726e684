"""GPTQ act-order layers vs the same layers without act-order, on bitkern's CPU kernels.

An act-order checkpoint is imported with its input columns sorted by group (weights and scales permuted once),
and the layer gathers x's columns in that order on every call (`bitkern.Linear.input_order`); the kernel is
the plain one.  The issue's target: at M=1 and M=16 the act-order layer within 10% of the plain layer.  Both
layers (uint4, GPTQ zeros, group 128, bf16 activations) take turns round by round (`interleaved`), weights
rotating through >= 1 GiB of copies so they come from DRAM; the ratio is the median of per-round ratios.
The gather is `torch.gather` with the order broadcast over x's rows (2-3x faster than `index_select`:
7 vs 16 us at M=1 and 54 vs 168 us at M=16, K=4096, bf16, Zen 4 2 cores).
Run: python -m pytest benchmarks/bench_act_order.py  (table: benchmarks/results/act_order.md).
"""

from __future__ import annotations

import copy
import statistics

import pytest
import torch

import bitkern
from bitkern.integration.formats import ImportedLinear

from conftest import interleaved, rotation, round_ratio

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]
GROUP = 128
TARGET = 1.10


def _layers(n: int, k: int, input_order):
    """The next layer of a rotation of copies of one uint4 layer (permuted inputs or not)."""
    weight = bitkern.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02, "uint4",
                              group_size=GROUP)
    layer = ImportedLinear(weight, input_order).to_module()
    return rotation(lambda: copy.deepcopy(layer), layer.nbytes)


@pytest.mark.parametrize("n, k", SHAPES)
def test_act_order_overhead(record, n, k):
    order = torch.randperm(k, generator=torch.Generator().manual_seed(1))
    plain, permuted = _layers(n, k, None), _layers(n, k, order)
    cases = {}
    for m in (1, 16):
        x = torch.randn(m, k).bfloat16()
        cases[("plain", m)] = lambda x=x: plain()(x)
        cases[("act-order", m)] = lambda x=x: permuted()(x)
        cases[("gather only", m)] = lambda x=x: torch.gather(x, -1, order.expand(*x.shape[:-1], k))
    with torch.no_grad():
        times = interleaved(cases)
    for m in (1, 16):
        ratio = round_ratio(times[("act-order", m)], times[("plain", m)])
        record("act_order", shape=f"{n}x{k}", M=m, plain_ms=statistics.median(times[("plain", m)]) * 1e3,
               act_order_ms=statistics.median(times[("act-order", m)]) * 1e3,
               gather_us=statistics.median(times[("gather only", m)]) * 1e6, ratio=ratio, target=TARGET,
               met=ratio <= TARGET)
