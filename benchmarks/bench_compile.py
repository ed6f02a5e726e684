"""Compile time per kernel, and no recompile on a second call with the same shape.

Each M bucket of the CPU matmul benchmark's types is tuned from an empty cache, as a user's first call does
(the shortlist built and timed); the table gives the code generation + LLVM compilation seconds of the
chosen kernel and of every candidate built, the whole first call, and the time a second call spends finding
the kernel for the same shape (no compile: the same kernel object comes back).
Run: python -m pytest benchmarks/bench_compile.py   (tables land in benchmarks/results/)
"""

from __future__ import annotations

import statistics
import time

import pytest

from bitkern.cache import forget, kernel_for
from bitkern.ops import Matmul
from bitkern.tuner.buckets import M_BUCKETS, TUNED_M

BUCKETS = [bucket for bucket in M_BUCKETS if bucket[1] <= 128]
CASES = [(dtype, "bfloat16") for dtype in ("int4", "nf4", "int8", "int2", "int1")] + [("int4", "float32")]


@pytest.mark.parametrize("bucket", BUCKETS)
@pytest.mark.parametrize("dtype, activation", CASES)
def test_compile_time(benchmark, record, tmp_path, monkeypatch, dtype, activation, bucket):
    """(The loops over K and N are runtime loops: the shape does not change what LLVM compiles.)"""
    n = k = 4096
    monkeypatch.setenv("BITKERN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("BITKERN_TUNING", raising=False)
    forget()
    spec, m = Matmul(dtype, activation, group_size=128), TUNED_M[bucket]
    start = time.perf_counter()
    kernel = kernel_for(spec, n, k, m, "tile16")
    first_call = time.perf_counter() - start
    builds = [t.build_s for t in kernel.record.trials if t.build_s is not None]
    benchmark.pedantic(lambda: kernel_for(spec, n, k, m, "tile16"), rounds=200, warmup_rounds=5)
    assert kernel_for(spec, n, k, m, "tile16") is kernel
    record("compile", type=dtype, activation=activation, N=n, K=k, bucket=f"{bucket[0]}..{bucket[1]}",
           template=kernel.template, chosen_build_s=kernel.build_seconds, median_build_s=statistics.median(builds),
           max_build_s=max(builds), built=len(builds), first_call_s=first_call,
           second_call_lookup_us=benchmark.stats.stats.median * 1e6)
