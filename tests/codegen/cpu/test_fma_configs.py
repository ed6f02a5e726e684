"""Every tiles-per-task count the FMA template offers for few rows, built directly (not chosen by the cost model)
at small shapes and checked against the float64 reference for M = 1..4: the last task's tiles past N, N not a multiple
of 16, a stacked q/k/v's N, SwiGLU's (gate, up) pairs and an output stage, at 256- and 512-bit vectors where this CPU
runs them.  Also the kernels a24f13a's cost model picked for tests/fusion/test_fuse.py's nf4 model (M = 3)."""

import pytest
import torch

import bitkern
from bitkern.codegen import build_kernel, pack
from bitkern.codegen.cpu import isa
from bitkern.codegen.cpu.fma import TEMPLATE, FmaConfig
from bitkern.codegen.cpu.kernel import PREFETCH_WORDS
from bitkern.ops import Matmul
from bitkern.tuner import host_cpu
from tests.helpers import assert_epilogue_matches_reference, assert_matches_reference

# the few-row buckets (`tuner.buckets`) and the row counts each serves
FEW_ROW_BUCKETS = {(1, 1): (1,), (2, 4): (2, 3, 4)}
# AVX2's 256-bit vectors and the widest level this CPU runs the template at (512-bit where it has AVX-512)
_RUNS = [level.name for level in isa.LEVELS if level.runs_on(host_cpu().level.features)
         and TEMPLATE.missing_features(host_cpu().at_level(level.name)) is None]
LEVELS = list(dict.fromkeys(_RUNS[:1] + _RUNS[-1:]))


def _case(dtype, n, k, zero_mode=None, group=32, epilogue="none", residual=False, seed=0):
    """(spec, quantized weight, bias, generator) of a random [N, K] weight with bfloat16 activations, float32 out."""
    generator = torch.Generator().manual_seed(seed)
    qweight = bitkern.quantize(torch.randn(n, k, generator=generator), dtype, group_size=group, zero_mode=zero_mode)
    spec = Matmul.for_weight(qweight, "bfloat16", bias=True, output_dtype="float32", epilogue=epilogue,
                             residual=residual)
    return spec, qweight, torch.randn(n, generator=generator), generator


def _check(kernel, spec, qweight, bias, generator, rows) -> None:
    """The kernel's output for each of `rows` random rows of x within the kernels' bound of the float64 reference
    (of the unfused computation for an epilogue or residual)."""
    packed = pack(qweight)
    for m in rows:
        x = torch.randn(m, qweight.shape[1], generator=generator).bfloat16()
        if spec.epilogue == "none" and not spec.residual:
            assert_matches_reference(spec, qweight, x, bias, kernel(x, packed, bias))
            continue
        residual = torch.randn(m, spec.out_features(qweight.shape[0]), generator=generator) if spec.residual else None
        y = kernel(x, packed, bias, residual) if spec.residual else kernel(x, packed, bias)
        assert_epilogue_matches_reference(spec, qweight, x, bias, residual, y)


# (dtype, zero mode, group, epilogue, residual, N, K)
SWEEP = [
    ("nf4", None, 32, "none", False, 40, 96),  # looked up; 3 tiles, the last half full
    ("int4", None, 32, "none", False, 72, 96),  # converted, signed; a stacked q/k/v of 40 + 24 + 8 rows
    ("uint4", "gptq", 32, "relu", True, 24, 64),  # zero points; the output stage with a residual
    ("nf4", None, 32, "swiglu", False, 96, 64),  # 3 (gate, up) pairs: tasks of 4 or 8 tiles hold 1 or 2 of them
    ("bfloat16", None, -1, "none", False, 8, 64),  # bfloat16 weights, per channel; N within one tile
]


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype, zero_mode, group, epilogue, residual, n, k", SWEEP)
def test_every_few_row_configuration_matches_the_reference(level, dtype, zero_mode, group, epilogue, residual, n,
                                                           k):
    """Each tiles-per-task count of each few-row bucket's space (the prefetch depth taken in turn: it only moves
    prefetches) for every row count of the bucket."""
    device = host_cpu().at_level(level)
    spec, qweight, bias, generator = _case(dtype, n, k, zero_mode, group, epilogue, residual)
    assert TEMPLATE.unsupported(spec, n, k, device) is None
    built = 0
    for bucket, rows in FEW_ROW_BUCKETS.items():
        configs = TEMPLATE.configs(spec, n, k, bucket, device, None)
        assert all(config.rows == 0 for config in configs)  # few rows: a body per row count, no blocks
        for tiles in sorted({config.n_tiles for config in configs}):
            config = FmaConfig(n_tiles=tiles, prefetch=PREFETCH_WORDS[built % len(PREFETCH_WORDS)])
            _check(build_kernel(spec, n, k, "fma", config, "tile16", bucket, device), spec, qweight, bias, generator,
                   rows)
            built += 1
    assert built >= 4  # both buckets, several tile counts at M = 1: the sweep covers what it says


# The fused model's FMA kernels under a24f13a's cost model (Zen 5, avx512-bf16): nf4 with groups of 32, bfloat16
# activations, M = 3 in the 2..4 bucket, 2 tiles a task, 64 words of prefetch; (epilogue, N, K)
A24F13A_KERNELS = [("swiglu", 192, 64), ("none", 64, 96), ("relu", 64, 64), ("none", 8, 64)]


@pytest.mark.parametrize("level", LEVELS[-1:])
@pytest.mark.parametrize("epilogue, n, k", A24F13A_KERNELS)
def test_the_configuration_a24f13a_picked_for_the_fused_model(level, epilogue, n, k):
    """The gate/up SwiGLU, down projection, ReLU head and output layer of test_fuse's model as that cost model
    built them, against the float64 reference (the fused test's failure then was these exact float32 sums against
    the separate layers' bf16-rounded nf4 products of the dot template, not a wrong sum)."""
    spec, qweight, bias, generator = _case("nf4", n, k, epilogue=epilogue, seed=n + k)
    kernel = build_kernel(spec, n, k, "fma", FmaConfig(n_tiles=2, prefetch=64), "tile16", (2, 4),
                          host_cpu().at_level(level))
    _check(kernel, spec, qweight, bias, generator, (3,))


def test_the_model_ranks_more_than_one_tile_a_task_first_at_decode():
    """x's broadcast serves a task's n_tiles tiles, and reading them at once costs no DRAM time (measured on Zen 4,
    int4 g128 at M=1, weights rotating through DRAM, 2 threads: 11264x2048 4 tiles 0.47 ms, 2 tiles 0.50, 1 tile
    0.67; 3072x2048 0.14, 0.15, 0.20), so the model's best configuration at those shapes takes more than 1 tile."""
    from bitkern.tuner.cost import estimate

    cpu = host_cpu()
    spec = Matmul("int4", "float32", group_size=128, scale_dtype="float16")
    for n, k in ((11264, 2048), (3072, 2048)):
        configs = TEMPLATE.configs(spec, n, k, (1, 1), cpu, None)
        best = min(configs, key=lambda config: estimate("fma", config, spec, n, k, 1, cpu).seconds)
        assert best.n_tiles > 1, (n, k, best)
