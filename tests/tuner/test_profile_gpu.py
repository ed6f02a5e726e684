"""The tuner's timing on a GPU (skipped without one): it times what the GPU does, not the host's dispatch."""

import statistics
import time

import pytest
import torch

from bitkern.tuner.profile import cuda_graph, time_kernels

pytestmark = pytest.mark.requires_cuda


def test_cuda_graph_sampler_times_the_gpu_not_the_host():
    """A call that spends 5 ms on the host and ~1 µs on the GPU samples far under 5 ms: the first H100 run
    timed eager calls between events and ranked candidates by bitkern's Python dispatch."""
    def slow_host_call():
        time.sleep(0.005)
        torch.cuda._sleep(1000)

    sample = cuda_graph([slow_host_call] * 4)
    assert statistics.median(sample() for _ in range(5)) < 0.001


def test_cuda_graph_sampler_ranks_gpu_work():
    """Calls that keep the GPU busy ten times longer sample about ten times longer, per call."""
    short, long = (cuda_graph([lambda cycles=cycles: torch.cuda._sleep(cycles)] * 3) for cycles in (100_000, 1_000_000))
    short_s, long_s = (statistics.median(sample() for _ in range(5)) for sample in (short, long))
    assert 5 < long_s / short_s < 20, (short_s, long_s)


def test_each_sample_replays_one_call():
    """A sample is one replay of one call (the first; as the GPU benchmark times a call)."""
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    sample = cuda_graph([lambda: counter.add_(1), lambda: counter.add_(100)])
    for _ in range(7):
        sample()
    assert int(counter) == 7


def test_time_kernels_gives_seconds_per_call_of_each_kernel():
    """Two kernels of ten times the GPU work: their medians about ten times apart, each well under a millisecond."""
    def kernel(cycles):
        return lambda x, weight, bias: torch.cuda._sleep(cycles)

    short, long = time_kernels([kernel(10_000), kernel(100_000)], None, ["w0", "w1", "w2"], None, budget_s=0.05,
                               sampler=cuda_graph)
    assert 0 < short < long < 0.001 and 5 < long / short < 20, (short, long)
