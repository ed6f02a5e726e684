"""A Llama-style MLP block (4096 -> 11008 -> 4096, SwiGLU) quantized by bitkern vs the float block.

Run:  python -m pytest benchmarks/bench_nn.py -q
Every model runs in the same process on the same inputs at batch 1 and 16; the closing table gives each
model's speed-up over the float32 and bfloat16 blocks (above 1: faster) and its weight memory.  The
quantized blocks take bfloat16 activations (AMX's fast path) and return bfloat16, as the bf16 block does.
"""

import copy

import pytest
import torch

import bitkern
from bitkern.demo import SwiGLU
from bitkern.nn.storage import QuantizedModule

DIM, HIDDEN = 4096, 11008
BATCHES = (1, 16)
QUANTIZED = ("int4", "nf4", "int8")
MODELS = ("float32", "bfloat16", *QUANTIZED)
_medians: dict = {}
_weight_bytes: dict = {}


@pytest.fixture(scope="module")
def models():
    """Float32, bfloat16 and quantized copies of one block.  up holds a copy of gate's weights (in its own
    memory), so each quantized block quantizes one [11008, 4096] weight for both; timings are unchanged."""
    torch.manual_seed(0)
    block = SwiGLU(DIM, HIDDEN).eval().requires_grad_(False)
    for linear in (block.gate, block.down):
        torch.nn.init.normal_(linear.weight, std=0.02)
    block.up.weight.copy_(block.gate.weight)
    built = {"float32": block, "bfloat16": copy.deepcopy(block).to(torch.bfloat16)}
    for name in QUANTIZED:
        quantized = SwiGLU.__new__(SwiGLU)
        torch.nn.Module.__init__(quantized)
        quantized.gate = bitkern.Linear.from_float(block.gate, name)
        quantized.up = copy.deepcopy(quantized.gate)
        quantized.down = bitkern.Linear.from_float(block.down, name)
        built[name] = quantized
    for name, model in built.items():
        _weight_bytes[name] = sum(m.nbytes if isinstance(m, QuantizedModule) else m.weight.nbytes
                                  for m in (model.gate, model.up, model.down))
    return built


@pytest.fixture(scope="module", autouse=True)
def ratio_table(request):
    """After the module: each model's speed-up over the float blocks, per batch."""
    yield
    if not _medians:
        return
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    with request.config.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled():
        for line in _table():
            reporter.write_line(line)


def _table() -> list[str]:
    lines = ["", f"Llama MLP {DIM} -> {HIDDEN} -> {DIM} (SwiGLU), {torch.get_num_threads()} threads: median time "
                 f"and speed-up over the float blocks (above 1: faster)",
             "| model | weights | " + " | ".join(f"batch {b}: ms | vs fp32 | vs bf16" for b in BATCHES) + " |",
             "|" + "---|" * (2 + 3 * len(BATCHES))]
    for name in MODELS:
        cells = [name, f"{_weight_bytes[name] / 2**20:.0f} MiB"]
        for batch in BATCHES:
            median = _medians.get((name, batch))
            if median is None:
                cells += ["-", "-", "-"]
                continue
            cells += [f"{median * 1e3:.2f}", f"{_medians[('float32', batch)] / median:.2f}x",
                      f"{_medians[('bfloat16', batch)] / median:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name", MODELS)
def test_mlp_block(benchmark, models, name, batch):
    model = models[name]
    dtype = torch.float32 if name == "float32" else torch.bfloat16
    x = torch.randn(batch, DIM, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        expected = models["float32"](x.float())
        y = model(x)  # compiles the kernels for this batch before timing
        assert y.dtype == dtype
        relative = float((y.float() - expected).norm() / expected.norm())
        # a sanity check (accuracy is tested in tests/): 4-bit round-to-nearest of N(0, 0.02²) weights is
        # ~10% off per weight, and the block multiplies two projections
        assert relative < 0.25, f"{name}: relative error {relative:.3g} against the float32 block"
        benchmark.group = f"batch {batch}"
        benchmark.extra_info["relative_error_vs_fp32"] = relative
        benchmark(model, x)
    if benchmark.stats is not None:  # None under --benchmark-disable
        _medians[(name, batch)] = benchmark.stats.stats.median
