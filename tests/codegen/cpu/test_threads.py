"""CPU kernels run their parallel loops on torch's own OpenMP threads: one pool for torch's ops and bitkern's
kernels, sized by torch.set_num_threads, safe from several Python threads at once."""

import os
import threading
import time

import pytest
import torch

import bitkern
from bitkern.cache import kernel_for
from bitkern.codegen import pack
from bitkern.codegen import build_kernel
from bitkern.codegen.cpu.runtime import load_runtime
from bitkern.ops import Matmul
from bitkern.tuner import host_cpu
from bitkern.tuner.buckets import m_bucket
from bitkern.tuner.space import enumerate_candidates


@pytest.fixture
def threads():
    """torch.set_num_threads for one test, restored afterwards."""
    previous = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(previous)


def _case(m, n=256, k=512, dtype="int4", group=128, seed=0):
    generator = torch.Generator().manual_seed(seed)
    quantized = bitkern.quantize(torch.randn(n, k, generator=generator), dtype, group_size=group)
    spec = Matmul.for_weight(quantized, "bfloat16", output_dtype="float32")
    return spec, pack(quantized), torch.randn(m, k, generator=generator).bfloat16()


def _os_threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _cpu_seconds() -> dict[str, float]:
    """User + system CPU seconds of every OS thread of this process."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended while we looked
            continue
        seconds[tid] = (int(fields[11]) + int(fields[12])) / ticks
    return seconds


def test_the_launcher_is_bound_to_torchs_openmp_runtime():
    assert load_runtime(), "bitkern's kernels fell back to TVM's thread pool (see the logged reason)"


@pytest.mark.parametrize("m", [1, 16, 200])
def test_kernels_start_no_threads_of_their_own(threads, m):
    """After torch's team exists, bitkern's kernels add no thread: TVM's pool (which would add one per extra
    core) never starts."""
    threads(2)
    spec, weight, x = _case(m)
    kernel = kernel_for(spec, *weight.shape, m, weight.layout)  # built or loaded, not called yet
    torch.ones(1 << 20).sum()
    before = _os_threads()
    for _ in range(20):
        kernel(x, weight)
    assert _os_threads() <= before


@pytest.mark.parametrize("count", [1, 2])
def test_kernels_use_as_many_threads_as_torch(threads, count):
    """With torch.set_num_threads(1) the calling thread does all the work; with 2, a second thread takes about
    half of it (per-thread CPU time from /proc, while only bitkern's kernel runs)."""
    threads(count)
    spec, weight, x = _case(512, n=1024, k=2048)
    spec(x, weight)
    time.sleep(0.05)  # let the workers of earlier parallel regions stop spinning
    caller = str(threading.get_native_id())
    before = _cpu_seconds()
    deadline = time.perf_counter() + 0.6
    while time.perf_counter() < deadline:
        spec(x, weight)
    after = _cpu_seconds()
    spent = {tid: after[tid] - before.get(tid, 0.0) for tid in after}
    others = sum(seconds for tid, seconds in spent.items() if tid != caller)
    if count == 1:
        assert others <= 0.1 * spent[caller] + 0.02, spent
    else:
        assert others >= 0.3 * spent[caller], spent


@pytest.mark.parametrize("m", [1, 3, 16, 200])
def test_results_do_not_depend_on_the_thread_count(threads, m):
    """Every template splits its work over output columns and row chunks, never over K: a row's sums are
    added in the same order whatever the number of threads, so the results are bitwise identical."""
    spec, weight, x = _case(m, n=272, k=768, seed=m)
    device = host_cpu()
    _, candidates = enumerate_candidates(spec, 272, 768, m_bucket(m), weight.layout, device)
    first_of_each = {c.template: c for c in reversed(candidates)}
    assert first_of_each
    for template, candidate in first_of_each.items():
        kernel = build_kernel(spec, 272, 768, template, candidate.config, weight.layout, m_bucket(m), device)
        results = []
        for count in (1, 2, 3):
            threads(count)
            results.append(kernel(x, weight))
        assert all(torch.equal(results[0], y) for y in results[1:]), template


def test_kernels_called_from_four_python_threads_at_once():
    """Each Python thread gets its own OpenMP team; results equal the single-threaded ones."""
    cases = [_case(m, seed=m) for m in (1, 4, 16, 64)]
    expected = [spec(x, weight) for spec, weight, x in cases]
    failures, barrier = [], threading.Barrier(len(cases))

    def work(index):
        spec, weight, x = cases[index]
        barrier.wait()
        for _ in range(25):
            if not torch.equal(spec(x, weight), expected[index]):
                failures.append(index)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not failures
