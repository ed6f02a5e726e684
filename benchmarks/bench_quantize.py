"""Quantization speed: `bitkern.Linear.from_float` of one 14336 x 4096 layer (a Llama-3-8B MLP weight) vs
reading the same weight from a safetensors checkpoint, in one run.

Rows: for each type, the weights per second of `from_float` (round-to-nearest, group 128, float32 and
bfloat16 weights in, the kernel layout out) at 1 thread and at torch's thread count, and the reads:
`safetensors` `get_tensor` from the page cache, and the file read from the disk with O_DIRECT (the page
cache bypassed: what loading a checkpoint that is not cached costs).  `vs_disk`: quantization rate / disk
read rate of the bfloat16 checkpoint (above 1: quantizing keeps up with reading).  Timings are medians over
rounds in which every case takes its turn (`interleaved`); the machine's 1-minute load average is in each row.
Table `quantize_method`: `bitkern.quantize` of a 4096 x 4096 bfloat16 weight (group 128, 2 threads) with each
`method` ("rtn", "hqq") per type and zero mode, in weights per second and as a ratio to "rtn" in the same run.
Table `quantize_gptq`: `bitkern.ttype.gptq` of the same weight against a given Hessian (group 128, 2 threads).
Run: python -m pytest benchmarks/bench_quantize.py  (tables `quantize`, `quantize_method`, `quantize_gptq` land
in benchmarks/results/).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import statistics
import time

import pytest
import safetensors
import safetensors.torch
import torch

import bitkern
from bitkern.ttype.gptq import Hessian, gptq

from conftest import interleaved

SHAPE = (14336, 4096)
TYPES = ("int4", "uint4", "int8", "nf4", "mxfp4")
METHOD_SHAPE, METHOD_THREADS = (4096, 4096), 2
METHOD_CASES = (("int4", "none"), ("uint4", "gptq"), ("uint4", "hqq"), ("nf4", "none"), ("mxfp4", "none"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A bfloat16 weight of SHAPE and a safetensors file holding it."""
    weight = (torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("checkpoint") / "model.safetensors"
    safetensors.torch.save_file({"weight": weight}, str(path))
    return weight, path


def _disk_read(path):
    """Read the whole file with O_DIRECT (no page cache), into a page-aligned buffer."""
    size = os.path.getsize(path)
    buffer = mmap.mmap(-1, -(-size // mmap.PAGESIZE) * mmap.PAGESIZE)
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        done = 0
        while done < size:
            done += os.preadv(descriptor, [memoryview(buffer)[done:]], done)
    finally:
        os.close(descriptor)


def _from_float(weight: torch.Tensor, dtype: str, threads: int):
    module = torch.nn.Linear(SHAPE[1], SHAPE[0], bias=False, device="meta", dtype=weight.dtype)
    module.weight = torch.nn.Parameter(weight, requires_grad=False)

    def call():
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            bitkern.Linear.from_float(module, dtype)
        finally:
            torch.set_num_threads(previous)

    return call


def test_quantize_keeps_up_with_reading(checkpoint, record):
    weight, path = checkpoint
    default = torch.get_num_threads()
    calls = {("read", "disk (O_DIRECT)", "bfloat16", 1): lambda: _disk_read(path),
             ("read", "page cache", "bfloat16", 1): lambda: safetensors.safe_open(str(path), "pt").get_tensor("weight")}
    for name in TYPES:
        for count in sorted({1, default}):
            calls[("quantize", name, "bfloat16", count)] = _from_float(weight, name, count)
        calls[("quantize", name, "float32", default)] = _from_float(weight.float(), name, default)
    seconds = interleaved(calls, rounds=5, round_s=0.0)
    disk = statistics.median(seconds["read", "disk (O_DIRECT)", "bfloat16", 1])
    load = _load_1min()
    for (kind, name, source, count), samples in seconds.items():
        median = statistics.median(samples)
        record("quantize", operation=kind, case=name, weights=source, threads=count,
               M_weights_per_s=SHAPE[0] * SHAPE[1] / median / 1e6, ms=median * 1e3, vs_disk=disk / median,
               load_1min=load)


@contextlib.contextmanager
def _method_threads():
    """torch at METHOD_THREADS threads inside the block, its own count restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(METHOD_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _load_1min() -> str:
    """The 1-minute load average, recorded beside each figure."""
    with open("/proc/loadavg") as loadavg:
        return loadavg.read().split()[0]


def test_quantize_methods(record):
    """Weights per second of each method at METHOD_THREADS threads, and "hqq"'s time over "rtn"'s."""
    weight = (torch.randn(METHOD_SHAPE, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)

    def call(name, zero_mode, method):
        return lambda: bitkern.quantize(weight, name, group_size=128 if name != "mxfp4" else None,
                                        zero_mode=zero_mode, method=method)

    with _method_threads():
        calls = {(name, zero_mode, method): call(name, zero_mode, method)
                 for name, zero_mode in METHOD_CASES for method in ("rtn", "hqq")}
        samples = interleaved(calls, rounds=3, round_s=0.0)
        seconds = {key: statistics.median(times) for key, times in samples.items()}
    load = _load_1min()
    for (name, zero_mode, method), median in seconds.items():
        record("quantize_method", case=name, zero_mode=zero_mode, method=method, threads=METHOD_THREADS,
               M_weights_per_s=METHOD_SHAPE[0] * METHOD_SHAPE[1] / median / 1e6,
               time_vs_rtn=median / seconds[name, zero_mode, "rtn"], load_1min=load)


def test_quantize_gptq(record):
    """Weights per second of method="gptq" (bitkern.ttype.gptq on one layer, its Hessian given: what quantize_model
    spends per layer besides the calibration forwards) at METHOD_THREADS threads, with and without act-order; one
    call per case (seconds each), after one small call that builds the rounding tables."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(METHOD_SHAPE, generator=generator) * 0.02).to(torch.bfloat16)
    hessian = Hessian(METHOD_SHAPE[1])
    hessian.add(torch.randn(2 * METHOD_SHAPE[1], METHOD_SHAPE[1], generator=generator))
    cases = [(name, zero_mode, act_order) for name, zero_mode in (("int4", "none"), ("uint4", "gptq"))
             for act_order in (False, True)]
    seconds = {}
    with _method_threads():
        for name, zero_mode, act_order in cases:
            gptq(weight[:16, :256], hessian.matrix[:256, :256], name, 128, zero_mode)
            start = time.perf_counter()
            gptq(weight, hessian.matrix, name, 128, zero_mode, act_order=act_order)
            seconds[name, zero_mode, act_order] = time.perf_counter() - start
    load = _load_1min()
    for (name, zero_mode, act_order), elapsed in seconds.items():
        record("quantize_gptq", case=name, zero_mode=zero_mode, act_order=act_order, threads=METHOD_THREADS,
               M_weights_per_s=METHOD_SHAPE[0] * METHOD_SHAPE[1] / elapsed / 1e6, load_1min=load)
