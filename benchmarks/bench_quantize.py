"""Quantization speed: `bitkern.Linear.from_float` of one 14336 x 4096 layer (a Llama-3-8B MLP weight) vs
reading the same weight from a safetensors checkpoint, in one run.

Rows: for each type, the weights per second of `from_float` (round-to-nearest, group 128, float32 and
bfloat16 weights in, the kernel layout out) at 1 thread and at torch's thread count, and the reads:
`safetensors` `get_tensor` from the page cache, and the file read from the disk with O_DIRECT (the page
cache bypassed: what loading a checkpoint that is not cached costs).  `vs_disk`: quantization rate / disk
read rate of the bfloat16 checkpoint (above 1: quantizing keeps up with reading).  Timings are medians over
rounds in which every case takes its turn (`interleaved`); the machine's 1-minute load average is in each row.
Run: python -m pytest benchmarks/bench_quantize.py  (table `quantize` lands in benchmarks/results/).
"""

from __future__ import annotations

import mmap
import os
import statistics

import pytest
import safetensors
import safetensors.torch
import torch

import bitkern

from conftest import interleaved

SHAPE = (14336, 4096)
TYPES = ("int4", "uint4", "int8", "nf4", "mxfp4")


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
    with open("/proc/loadavg") as loadavg:
        load = loadavg.read().split()[0]
    for (kind, name, source, count), samples in seconds.items():
        median = statistics.median(samples)
        record("quantize", operation=kind, case=name, weights=source, threads=count,
               M_weights_per_s=SHAPE[0] * SHAPE[1] / median / 1e6, ms=median * 1e3, vs_disk=disk / median,
               load_1min=load)
