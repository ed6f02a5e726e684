"""A Llama-style MLP block (4096 -> 11008 -> 4096, SwiGLU) quantized by bitkern vs the float blocks, one run.

The float32 and bfloat16 torch blocks and bitkern blocks (group size 128, bfloat16 activations in and out:
the AMX fast path) run at batch 1 (decoding) and 16.  Each model rotates through >= 1 GiB of copies so its
weights come from DRAM on every call.  Tables: `nn_mlp` (median ms, weight GB/s and its fraction of the
DRAM read bandwidth measured in this run) and `nn_mlp_speedup` (each model's speed-up over the float32 and
bfloat16 blocks at the same batch; above 1: faster).
Run: python -m pytest benchmarks/bench_nn.py  (tables land in benchmarks/results/).
"""

from __future__ import annotations

import copy

import pytest
import torch

import bitkern
from bitkern.demo import SwiGLU
from bitkern.nn.storage import QuantizedModule

from conftest import measure, recorded, rotation

DIM, HIDDEN = 4096, 11008
BATCHES = (1, 16)
QUANTIZED = ("int4", "nf4", "int8")
MODELS = ("torch_fp32", "torch_bf16", *(f"bitkern_{name}" for name in QUANTIZED))
_rotating: dict = {}  # the one model whose copies are held (the runs are grouped by model)


@pytest.fixture(scope="module")
def float_block():
    """The float32 block.  up holds a copy of gate's weights (in its own memory), so a quantized block
    quantizes one [11008, 4096] weight for both; the kernels time the same either way."""
    torch.manual_seed(0)
    block = SwiGLU(DIM, HIDDEN).eval().requires_grad_(False)
    for linear in (block.gate, block.down):
        torch.nn.init.normal_(linear.weight, std=0.02)
    block.up.weight.copy_(block.gate.weight)
    return block


def _build(name: str, block: SwiGLU) -> SwiGLU:
    if name == "torch_fp32":
        return block
    if name == "torch_bf16":
        return copy.deepcopy(block).to(torch.bfloat16)
    quantized = SwiGLU.__new__(SwiGLU)
    torch.nn.Module.__init__(quantized)
    quantized.gate = bitkern.Linear.from_float(block.gate, name.removeprefix("bitkern_"))
    quantized.up = copy.deepcopy(quantized.gate)
    quantized.down = bitkern.Linear.from_float(block.down, name.removeprefix("bitkern_"))
    return quantized


def _weight_bytes(model: SwiGLU) -> int:
    return sum(m.nbytes if isinstance(m, QuantizedModule) else m.weight.nbytes
               for m in (model.gate, model.up, model.down))


def _rotation(name: str, block: SwiGLU):
    """The model, and a function giving the next of its copies (>= 1 GiB in all)."""
    if name not in _rotating:
        _rotating.clear()
        model = _build(name, block)
        _rotating[name] = model, rotation(lambda: copy.deepcopy(model), _weight_bytes(model))
    return _rotating[name]


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name", MODELS)
def test_mlp_block(benchmark, record, dram_read_gbs, float_block, name, batch):
    model, next_copy = _rotation(name, float_block)
    dtype = torch.float32 if name == "torch_fp32" else torch.bfloat16
    x = torch.randn(batch, DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        expected = float_block(x.float())
        y = model(x)
        assert y.dtype == dtype
        # a sanity check (accuracy is tested in tests/): 4-bit round-to-nearest of N(0, 0.02²) weights is
        # ~10% off per weight, and the block multiplies two projections
        relative = float((y.float() - expected).norm() / expected.norm())
        assert relative < 0.25, f"{name}: relative error {relative:.3g} against the float32 block"
        seconds = measure(benchmark, lambda: next_copy()(x), rounds=(5, 200), warmup_rounds=1)
    nbytes = _weight_bytes(model)
    gbs = nbytes / seconds / 1e9
    record("nn_mlp", model=name, batch=batch, ms=seconds * 1e3, weight_MB=nbytes / 1e6, GBps=gbs,
           dram_fraction=gbs / dram_read_gbs, rel_error=relative)
    benchmark.extra_info.update(GBps=gbs, dram_fraction=gbs / dram_read_gbs, relative_error_vs_fp32=relative)


def test_speedups(record):
    """Each model's speed-up over the float blocks, from this run's rows (reported, not asserted)."""
    _rotating.clear()
    rows = {(r["model"], r["batch"]): r for r in recorded("nn_mlp")}
    for batch in BATCHES:
        fp32, bf16 = rows.get(("torch_fp32", batch)), rows.get(("torch_bf16", batch))
        for name in MODELS:
            row = rows.get((name, batch))
            if row and fp32 and bf16:
                record("nn_mlp_speedup", model=name, batch=batch, ms=row["ms"], vs_fp32=fp32["ms"] / row["ms"],
                       vs_bf16=bf16["ms"] / row["ms"])
