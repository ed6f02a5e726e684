"""Build candidate kernels in parallel and time them on the device they are for."""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..codegen.cpu.build import build_kernel
from ..codegen.cpu.layout import PackedWeight, to_layout
from ..ops.matmul import Matmul
from ..ttype import get, quantize, torch_dtype

PROFILE_MAX_BYTES = 2 << 30


def profile_bytes(device) -> int:
    """Weights rotate through this much memory while timing: three last-level caches, so memory-bound
    candidates are timed reading DRAM as they will in use (a cache-resident rotation favours compute)."""
    return min(PROFILE_MAX_BYTES, max(64 << 20, 3 * getattr(device, "llc_bytes", 0)))


def build_all(candidates, spec: Matmul, n: int, k: int, layout: str, bucket, device) -> list:
    """Compile every candidate (TVM releases the interpreter while compiling: a thread per core)."""
    def build(candidate):
        return build_kernel(spec, n, k, candidate.template, candidate.config, layout, bucket, device)

    with ThreadPoolExecutor(max_workers=max(1, device.cores)) as pool:
        return list(pool.map(build, candidates))


def inputs(spec: Matmul, n: int, k: int, m: int, layout: str, device):
    """Random inputs of the kernel's shape: x, a rotation of packed weights (random codes: any bit pattern
    is a valid code, and timing does not depend on the values), bias."""
    generator = torch.Generator().manual_seed(0)
    shapes = to_layout(_tiny_weight(spec, k), layout)  # the layout's tensor kinds, from a 1-row weight
    packed = _random_packed(spec, n, k, layout, shapes, generator)
    copies = [packed] + [_clone(packed) for _ in range(max(1, profile_bytes(device) // max(1, packed.nbytes)) - 1)]
    x = torch.randn(spec.input_shape(m, k), generator=generator)
    x = x.mul(16).round().clamp(-128, 127).to(torch.int8) if spec.activation_dtype == "int8" else \
        x.to(torch_dtype(spec.activation_dtype))
    bias = torch.randn(n, generator=generator) if spec.bias else None
    return x, copies, bias


def _tiny_weight(spec: Matmul, k: int):
    block = get(spec.weight_dtype).block_size > 1
    return quantize(torch.ones(1, k), spec.weight_dtype, group_size=None if block else spec.group_size,
                    zero_mode=spec.zero_mode, scale_dtype=getattr(torch, spec.scale_dtype))


def _random_packed(spec: Matmul, n: int, k: int, layout: str, like, generator):
    """A packed weight of N rows with random codes, scales near 1 and valid zeros, shaped like `like`."""
    ttype = get(spec.weight_dtype)
    rows = -(-n // 16) * 16 if layout == "tile16" else n

    def grow(tensor, fill):
        if tensor is None:
            return None
        shape = list(tensor.shape)
        shape[0] = rows // 16 if layout == "tile16" else n
        return fill(shape, tensor.dtype)

    words = grow(like.qweight, lambda shape, dtype: torch.randint(-2**31, 2**31 - 1, shape, generator=generator,
                                                                   dtype=torch.int32))
    scales = grow(like.scales, lambda shape, dtype: (torch.randint(120, 130, shape, generator=generator)
                                                     .to(dtype) if dtype == torch.uint8 else
                                                     (torch.rand(shape, generator=generator) + 0.5).to(dtype)))
    zeros = grow(like.zeros, lambda shape, dtype: (torch.randint(0, ttype.num_codes, shape, generator=generator)
                                                   .to(dtype)))
    return PackedWeight(layout, ttype, (n, k), like.group_size, like.zero_mode, words, scales, zeros,
                        like.tensor_scale)


def time_kernels(kernels, x, copies, bias, budget_s: float = 0.15) -> list[float]:
    """Median seconds per call of each kernel (within about `budget_s` each), rotating through the weight
    copies.  The kernels take turns call by call, so that drift in the machine's speed (other processes,
    clocks) hits them all alike: timed one after another, candidates within ~5% were ranked by the drift."""
    for kernel in kernels:
        for weight in copies[:2]:
            kernel(x, weight, bias)
    start = time.perf_counter()
    for kernel in kernels:
        kernel(x, copies[0], bias)
    once = max((time.perf_counter() - start) / len(kernels), 1e-7)
    samples = [[] for _ in kernels]
    for i in range(max(5, min(200, int(budget_s / once)))):
        for j, kernel in enumerate(kernels):
            weight = copies[(i * len(kernels) + j) % len(copies)]
            start = time.perf_counter()
            kernel(x, weight, bias)
            samples[j].append(time.perf_counter() - start)
    return [statistics.median(column) for column in samples]


def time_kernel(kernel, x, copies, bias, budget_s: float = 0.15) -> float:
    """Median seconds per call of one kernel (see `time_kernels`)."""
    return time_kernels([kernel], x, copies, bias, budget_s)[0]


def _clone(packed):
    def copy(tensor):
        return None if tensor is None else tensor.clone()

    return type(packed)(packed.layout, packed.ttype, packed.shape, packed.group_size, packed.zero_mode,
                        copy(packed.qweight), copy(packed.scales), copy(packed.zeros), copy(packed.tensor_scale))


def build_all_cuda(candidates, spec: Matmul, n: int, k: int, bucket, device) -> list:
    """Compile every candidate for the CUDA arch (nvcc runs in parallel subprocesses: a thread each)."""
    from ..codegen.cuda import build_kernel

    def build(candidate):
        return build_kernel(spec, n, k, candidate.template, candidate.config, device.arch, bucket)

    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(build, candidates))


def cuda_inputs(spec: Matmul, n: int, k: int, m: int):
    """Inputs on the current GPU: x, a rotation of packed weights (random codes) beyond the L2, bias."""
    from ..codegen.cuda import pack

    generator = torch.Generator().manual_seed(0)
    block = get(spec.weight_dtype).block_size > 1
    quantized = quantize(torch.randn(n, k, generator=generator) * 0.02, spec.weight_dtype,
                         group_size=None if block else spec.group_size, zero_mode=spec.zero_mode,
                         scale_dtype=getattr(torch, spec.scale_dtype))
    packed = pack(quantized.to("cuda"))
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    copies = [packed] + [_clone(packed) for _ in range(max(1, 4 * l2 // max(1, packed.nbytes)))]
    x = torch.randn(m, k, generator=generator).to("cuda")
    x = x.mul(16).round().clamp(-128, 127).to(torch.int8) if spec.activation_dtype == "int8" else \
        x.to(torch_dtype(spec.activation_dtype))
    bias = torch.randn(n, generator=generator).to("cuda") if spec.bias else None
    return x, copies, bias


def time_cuda_kernel(kernel, x, copies, bias, calls: int = 50) -> float:
    """Median seconds per call measured with CUDA events, rotating through the weight copies."""
    for weight in copies[:2]:
        kernel(x, weight, bias)
    torch.cuda.synchronize()
    samples = []
    for i in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        kernel(x, copies[i % len(copies)], bias)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    samples.sort()
    return samples[len(samples) // 2]
