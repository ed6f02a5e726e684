"""Build candidate kernels in parallel and time them on the device they are for."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..codegen import KernelBuildError, build_kernel, packed_class, tensor_rows, to_layout
from ..ops.matmul import Matmul
from ..ttype import get, quantize, torch_dtype

log = logging.getLogger("bitkern")

PROFILE_MAX_BYTES = 2 << 30
NVCC_JOBS = 4  # nvcc builds run in subprocesses: a thread each
# bytes a CUDA sample writes before its call, flushing the L2 (what triton.testing.do_bench writes, as the GPU
# benchmark times its calls)
FLUSH_BYTES = 256 << 20


def profile_bytes(device) -> int:
    """Weights rotate through this much memory while timing, so memory-bound candidates are timed reading DRAM as
    they will in use (a cache-resident rotation favours compute): three last-level caches of a CPU; nothing on a GPU,
    where each sample flushes the L2 before its call (`cuda_graph`), so one weight is read from DRAM."""
    if device.kind == "cuda":
        return 0
    return min(PROFILE_MAX_BYTES, max(64 << 20, 3 * device.llc_bytes))


def build_all(candidates, spec: Matmul, n: int, k: int, layout: str, bucket, device) -> list:
    """Compile every candidate, in parallel (LLVM and nvcc run in subprocesses, a thread waits on each).  A candidate
    the compiler refuses, or whose compiling process dies, is logged with the reason and is its KernelBuildError
    in the list."""
    def build(candidate):
        try:
            return build_kernel(spec, n, k, candidate.template, candidate.config, layout, bucket, device)
        except KernelBuildError as error:
            log.warning("bitkern: skipped the %s candidate %s of %s: it failed to build: %s", candidate.template,
                        candidate.config, describe(spec, n, k, bucket, device), error)
            return error

    workers = max(1, device.cores) if device.kind == "cpu" else NVCC_JOBS
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(build, candidates))


def describe(spec: Matmul, n: int, k: int, bucket, device) -> str:
    """A kernel in words, for messages: its types, weight shape, rows and target."""
    return (f"the {spec.weight_dtype} x {spec.activation_dtype} kernel of a [{n}, {k}] weight for rows {bucket[0]}.."
            f"{bucket[1]} on {device.key}")


def inputs(spec: Matmul, n: int, k: int, m: int, layout: str, device):
    """Random inputs of the kernel's shape on its device: x, a rotation of packed weights (random codes: any bit
    pattern is a valid code, and timing does not depend on the values), bias."""
    generator = torch.Generator().manual_seed(0)
    where = "cpu" if device.kind == "cpu" else "cuda"
    if spec.experts:
        copies = _expert_windows(spec, n, k, m, layout, device, generator)
    else:
        packed = random_packed(spec, n, k, layout, generator).to(where)
        copies = [packed] + [_clone(packed) for _ in range(max(1, profile_bytes(device) // max(1, packed.nbytes)) - 1)]
    x = torch.randn(spec.input_shape(m, k), generator=generator)
    x = x.mul(16).round().clamp(-128, 127).to(torch.int8) if spec.activation_dtype == "int8" else \
        x.to(torch_dtype(spec.activation_dtype))
    bias = torch.randn((spec.experts, n) if spec.experts else (n,), generator=generator) if spec.bias else None
    return x.to(where), copies, None if bias is None else bias.to(where)


def stage_inputs(spec: Matmul, n: int, k: int, m: int, device) -> dict:
    """The keyword arguments a kernel of `spec` takes beyond (x, weight, bias) for M rows: the residual its output
    stage adds, the norm weight (and bias) of its prologue, a grouped spec's routing (each row to top_k distinct
    experts, with equal weights where it combines them); empty for a spec with none of them."""
    where = "cpu" if device.kind == "cpu" else "cuda"
    extras = {}
    if spec.experts:  # row r to experts r·top_k, r·top_k + 1, ...: the first min(E, M·top_k) (`_expert_windows`)
        extras["indices"] = (torch.arange(m * spec.top_k).view(m, spec.top_k) % spec.experts).to(where)
        if spec.combine:
            extras["weights"] = torch.full((m, spec.top_k), 1 / spec.top_k, device=where)
    if spec.residual:
        extras["residual"] = torch.randn(m, spec.out_features(n)).to(torch_dtype(spec.output_dtype)).to(where)
    if spec.norm != "none":
        extras["norm"] = (torch.ones(k, device=where), torch.zeros(k, device=where) if spec.norm == "layernorm" else
                          None)
    return extras


def _expert_windows(spec: Matmul, n: int, k: int, m: int, layout: str, device, generator) -> list:
    """A grouped spec's rotation: stacks of E experts that are windows of one larger random stack, each starting
    where the experts the timing routing selects (the first min(E, M·top_k), `stage_inputs`) of the one before end,
    as many as make `profile_bytes` of selected experts, so that every call reads its experts from DRAM as a decode
    step does (whole copies of the stack would take gigabytes; one would be read from the caches)."""
    selected = min(spec.experts, m * spec.top_k)
    one = random_packed(spec, n, k, layout, generator)
    count = max(2, profile_bytes(device) // max(1, selected * one.nbytes))
    stack = random_packed(spec, (spec.experts + (count - 1) * selected) * n, k, layout, generator)
    where = "cpu" if device.kind == "cpu" else "cuda"
    stack = stack.to(where)
    tiles = tensor_rows(layout, n)  # an expert's first-dimension rows in the layout's tensors
    stacked_format = dataclasses.replace(stack.format, shape=(spec.experts * n, k))
    return [type(stack).from_format(stacked_format, *(
        None if t is None else t[i * selected * tiles:(i * selected + spec.experts) * tiles] for t in stack.tensors()))
        for i in range(count)]


def _tiny_weight(spec: Matmul, k: int):
    block = get(spec.weight_dtype).block_size > 1
    return quantize(torch.ones(1, k), spec.weight_dtype, group_size=None if block else spec.group_size,
                    zero_mode=spec.zero_mode, scale_dtype=getattr(torch, spec.scale_dtype))


def random_packed(spec: Matmul, n: int, k: int, layout: str, generator):
    """A packed weight of N rows with random codes, scales near 1 and valid zeros, its tensors shaped like those
    of a one-row weight in `layout` but for their rows."""
    ttype = get(spec.weight_dtype)
    like = to_layout(_tiny_weight(spec, k), layout)
    rows = tensor_rows(layout, n)

    def grow(tensor, fill):
        return None if tensor is None else fill([rows, *tensor.shape[1:]], tensor.dtype)

    words = grow(like.qweight, lambda shape, dtype: torch.randint(-2**31, 2**31 - 1, shape, generator=generator,
                                                                   dtype=torch.int32))
    scales = grow(like.scales, lambda shape, dtype: (torch.randint(120, 130, shape, generator=generator)
                                                     .to(dtype) if dtype == torch.uint8 else
                                                     (torch.rand(shape, generator=generator) + 0.5).to(dtype)))
    zeros = grow(like.zeros, lambda shape, dtype: (torch.randint(0, ttype.num_codes, shape, generator=generator)
                                                   .to(dtype)))
    return packed_class(layout)(layout, ttype, (n, k), like.group_size, like.zero_mode, words, scales, zeros,
                                like.tensor_scale)


def wall_clock(calls):
    """A sampler of host kernels: each sample is the wall-clock time of the next of `calls` (CPU kernels run to
    completion before returning)."""
    turn = itertools.count()

    def sample() -> float:
        call = calls[next(turn) % len(calls)]
        start = time.perf_counter()
        call()
        return time.perf_counter() - start
    return sample


def cuda_graph(calls):
    """A sampler of CUDA kernels that times a call as the GPU benchmark does (`benchmarks/bench_gpu.py`): the first of
    `calls` captured alone in a CUDA graph, each sample its replay between CUDA events after FLUSH_BYTES are written
    to flush the L2, so its weights come from DRAM; seconds per call.  Eager calls between events measured the host's
    Python dispatch (~0.1 ms a call on an H100, whatever the kernel), and 64 calls back to back in one graph found the
    L2 warm: on the H100 run of 2026-11-27 the tuner put four M=1 picks 7-11% ahead that the benchmark put 9-13%
    behind."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls[0]()
    flush = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")

    def sample() -> float:
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    return sample


SAMPLERS = {"cpu": wall_clock, "cuda": cuda_graph}


def time_kernels(kernels, x, copies, bias, budget_s: float = 0.15, sampler=wall_clock) -> list[float]:
    """Median seconds per call of each kernel (within about `budget_s` each), rotating through the weight
    copies (each kernel's calls start at its own copy; a CUDA sample times that first call alone).  The kernels take
    turns sample by sample, so that drift in the machine's speed (other processes, clocks) hits them all alike: timed
    one after another, candidates within ~5% were ranked by the drift."""
    for kernel in kernels:
        for weight in copies[:2]:
            kernel(x, weight, bias)
    samplers = [sampler([functools.partial(kernel, x, copies[(i + j) % len(copies)], bias)
                         for i in range(len(copies))]) for j, kernel in enumerate(kernels)]
    began = time.perf_counter()
    for sample in samplers:
        sample()
    once = max((time.perf_counter() - began) / len(samplers), 1e-7)  # a sample's cost (a graph replays many calls)
    samples = [[] for _ in kernels]
    for _ in range(max(5, min(200, int(budget_s / once)))):
        for j, sample in enumerate(samplers):
            samples[j].append(sample())
    return [statistics.median(column) for column in samples]


def time_kernel(kernel, x, copies, bias, budget_s: float = 0.15, sampler=wall_clock) -> float:
    """Median seconds per call of one kernel (see `time_kernels`)."""
    return time_kernels([kernel], x, copies, bias, budget_s, sampler)[0]


def _clone(packed):
    return type(packed).from_format(packed.format, *(None if t is None else t.clone() for t in packed.tensors()))
