"""The grouped VNNI template (`codegen.cpu.grouped_vnni`, `emit.grouped_vnni`): one launch for rows routed to their
top-k of stacked experts with int8 activations (activation_quant="int8"), against the float64 reference
(`ops.GroupedMatmul`, x quantized as `ops.matmul.activation_blocks` defines) for every type the VNNI template serves,
top-k 1 to 8, experts no row picks, one expert taking every row (more than a block's rows), the same expert picked
twice, fuzzed routings, non-finite x, biases and partial tile blocks; the output stage's SwiGLU on each expert's [gate;
up] halves and weighted top-k sum (combine) the same way; at every level this CPU runs (x86-64-v3 forced), compiled to
its byte dot product above it; the tuner and the cache through the spec's call."""

import pytest
import torch

from bitkern.codegen import build_kernel, pack
from bitkern.codegen.cpu import isa
from bitkern.codegen.cpu.grouped_vnni import TEMPLATE
from bitkern.codegen.cpu.kernel import disassembly
from bitkern.codegen.cpu.vnni import VnniConfig, dot_instruction
from bitkern.ops import GroupedMatmul
from bitkern.ops.matmul import quantize_activations
from bitkern.tuner import host_cpu
from bitkern.tuner.space import usable_templates
from tests.codegen.cpu.test_grouped import (E, K, N, N_SWIGLU, OUTPUT_STAGES, _distinct, _routed_inputs,
                                            routings_of_three)
from tests.codegen.cpu.test_grouped import _case as grouped_case
from tests.helpers import OUTPUT_EPS, assert_grouped_output_within_bound, vnni_magnitudes

LEVELS = [level.name for level in (*isa.LEVELS, *isa.ARM_LEVELS) if TEMPLATE.runs_at(level) and level.runs_on(
    host_cpu().level.features)]  # on an aarch64 host, its levels with the dot product
ABOVE = [level.name for level in isa.LEVELS if TEMPLATE.runs_at(level) and host_cpu().level.arch == "x86_64"
         and level.name not in LEVELS]
pytestmark = pytest.mark.skipif(not LEVELS, reason="a CPU with a byte dot product (AVX2, aarch64's dotprod)")
# (dtype, zero mode, group): integer codes (symmetric, zero points) of 1 to 8 bits, 4-bit code books and floats
TYPES = [("int4", None, 64), ("uint4", "gptq", 64), ("uint4", "hqq", 64), ("int8", None, 64), ("uint8", "gptq", 64),
         ("int2", None, 64), ("int1", None, 64), ("nf4", None, 64), ("fp4_e2m1", None, 64), ("mxfp4", None, 32)]


def _case(*args, **fields):
    return grouped_case(*args, activation_quant="int8", **fields)


def _check(spec, weight, bias, y, x, indices):
    """y within the VNNI kernels' bound of the float64 reference, pair by pair: 1e-5 of Σ|x̃|·`vnni_magnitudes` of
    the pair's expert, and the output's rounding."""
    assert y.shape == (x.shape[0], spec.top_k, N) and y.dtype == getattr(torch, spec.output_dtype)
    reference = spec.exact(x, weight, indices, bias)
    magnitudes = vnni_magnitudes(weight).view(spec.experts, N, K)[indices.long()]
    magnitude = torch.einsum("mk,mjnk->mjn", quantize_activations(x).abs(), magnitudes)
    excess = (y.double() - reference).abs() - (1e-5 * magnitude + OUTPUT_EPS[spec.output_dtype] * reference.abs())
    assert float(excess.max()) <= 1e-30, f"max excess {float(excess.max()):.3g}"


def _build(spec, level, config=VnniConfig(n_tiles=2, rows=1, prefetch=16)):
    n = N_SWIGLU if spec.epilogue == "swiglu" else N
    return build_kernel(spec, n, K, "grouped_vnni", config, "tile16", (1, 16), host_cpu().at_level(level))


@pytest.mark.parametrize("level", sorted({LEVELS[0], LEVELS[-1]}) if LEVELS else [])
@pytest.mark.parametrize("dtype, zero_mode, group", TYPES)
def test_every_type_matches_the_reference(level, dtype, zero_mode, group):
    spec, weight, bias = _case(dtype, zero_mode, group, top_k=2)
    assert TEMPLATE.unsupported(spec, N, K, host_cpu()) is None
    kernel = _build(spec, level, VnniConfig(n_tiles=2, rows=2, prefetch=16))
    for tokens in (1, 2, 4, 7):
        x = torch.randn(tokens, K, generator=torch.Generator().manual_seed(tokens)) * 10.0 ** (tokens % 3 - 1)
        _check(spec, weight, bias, kernel(x, pack(weight), bias, indices=_distinct(tokens, 2, E, tokens)), x,
               _distinct(tokens, 2, E, tokens))


@pytest.mark.parametrize("level", LEVELS)
def test_top_k_one_to_eight_at_every_level(level):
    """Eight experts, each token's top-k distinct, k from 1 to 8, the activation types in turn; one kernel per k,
    its configuration varied (tiles at once or in turn, rows per block, prefetch)."""
    for top_k in range(1, 9):
        activation = ("bfloat16", "float16", "float32")[top_k % 3]
        spec, weight, bias = _case("int4", None, 64, top_k, activation, experts=8, seed=top_k)
        rows = (1, 2, 4)[top_k % 3]
        config = VnniConfig(n_tiles=2 if rows == 4 else 1 + top_k % 2 * 3, rows=rows, prefetch=32 * (top_k % 2),
                            in_turn=top_k % 4 == 0)
        kernel = _build(spec, level, config)
        for tokens in (1, 3):
            x = torch.randn(tokens, K, generator=torch.Generator().manual_seed(top_k)).to(getattr(torch, activation))
            indices = _distinct(tokens, top_k, 8, top_k)
            _check(spec, weight, bias, kernel(x, pack(weight), bias, indices=indices), x, indices)


def test_routings_empty_experts_one_expert_for_all_shared_experts_and_fuzzed():
    spec, weight, bias = _case("uint4", "gptq", 64, top_k=2)
    one = dict(zip(("spec", "weight", "bias"), _case("nf4", None, 64, top_k=1)))
    kernel = _build(spec, LEVELS[-1], VnniConfig(n_tiles=2, rows=2, prefetch=16))
    single = _build(one["spec"], LEVELS[-1], VnniConfig(n_tiles=2, rows=4, prefetch=0))
    packed, packed_one = pack(weight), pack(one["weight"])
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(1))
    # expert 4 takes all 9 rows (blocks of 4, 4 and 1), experts 0..3 and 5 none
    indices = torch.full((9, 1), 4, dtype=torch.int32)
    _check(one["spec"], one["weight"], one["bias"], single(x, packed_one, one["bias"], indices=indices), x, indices)
    # expert 2 picked by every token, expert 5 by two of them, the others by none
    indices = torch.tensor([[2, 5], [5, 2], [2, 0], [1, 2]])
    _check(spec, weight, bias, kernel(x[:4], packed, bias, indices=indices), x[:4], indices)
    # a token picking the same expert twice gets the same row twice
    y = kernel(x[:1], packed, bias, indices=torch.tensor([[3, 3]]))
    assert torch.equal(y[0, 0], y[0, 1])
    generator = torch.Generator().manual_seed(7)
    for trial in range(12):  # fuzzed: any expert in any slot, repeats allowed, 1 to 12 tokens, int32 or int64
        tokens = int(torch.randint(1, 13, (1,), generator=generator))
        indices = torch.randint(0, E, (tokens, 2), generator=generator)
        indices = indices if trial % 2 else indices.int()
        x = torch.randn(tokens, K, generator=generator)
        _check(spec, weight, bias, kernel(x, packed, bias, indices=indices), x, indices)


def test_without_a_bias_with_bfloat16_output_and_non_finite_x():
    """A row with an Inf keeps ±Inf where the reference has it, a NaN makes its pairs NaN, other rows are as
    without them."""
    spec, weight, _ = _case("int8", None, 64, top_k=3, activation="bfloat16", bias=False)
    kernel = _build(spec, LEVELS[0])
    x = torch.randn(3, K).bfloat16()
    indices = _distinct(3, 3, E, 3)
    _check(spec, weight, None, kernel(x, pack(weight), None, indices=indices), x, indices)
    x[0, 7], x[1, 100] = float("inf"), float("nan")
    y, reference = kernel(x, pack(weight), None, indices=indices), spec.exact(x, weight, indices)
    assert torch.equal(torch.isnan(y), torch.isnan(reference)) and torch.equal(torch.isinf(y), torch.isinf(reference))
    assert bool(torch.isnan(y[1]).all()) and bool(torch.isfinite(y[2]).all())


@pytest.mark.parametrize("level", ABOVE)
@pytest.mark.parametrize("epilogue, combine", [("none", False), ("swiglu", True)])
def test_levels_above_this_cpu_compile_to_their_byte_products(level, epilogue, combine):
    spec, _, _ = _case("int4", None, 64, top_k=2, epilogue=epilogue, combine=combine)
    kernel = build_kernel(spec, N_SWIGLU if combine else N, K, "grouped_vnni", VnniConfig(2, prefetch=16), "tile16",
                          (1, 16), host_cpu().at_level(level))
    assert dot_instruction(isa.level(level)) in disassembly(kernel.library)


def test_the_tuner_offers_it_for_int8_activations_only_and_the_cache_serves_it():
    spec, weight, bias = _case("int4", None, 64, top_k=2)
    usable, unused = usable_templates(spec, N, K, (1, 1), "tile16", host_cpu())
    assert [t.name for t in usable] == ["grouped_vnni"]
    assert unused["grouped_fma"].startswith("activation_quant='int8'") and unused["vnni"].startswith("a grouped spec")
    float_spec = GroupedMatmul("int4", "float32", group_size=64, experts=E, top_k=2)
    assert unused_reason(float_spec).startswith("activation_quant='none'")
    nvfp4 = GroupedMatmul("nvfp4", "float32", group_size=16, experts=E, top_k=2, activation_quant="int8")
    assert "a scale per tensor" in unused_reason(nvfp4)
    x = torch.randn(3, K)
    indices = _distinct(3, 2, E, 0)
    _check(spec, weight, bias, spec(x, pack(weight), indices, bias), x, indices)
    assert spec(x[:0], pack(weight), indices[:0], bias).shape == (0, 2, N)


def unused_reason(spec) -> str:
    return usable_templates(spec, N, K, (1, 1), "tile16", host_cpu())[1]["grouped_vnni"]


def test_the_model_ranks_it_by_the_experts_a_call_selects():
    """The cost model counts the selected experts' weights once: a top-8 decode step reads 8 experts' bytes, a top-1
    one 1, whatever the experts' number."""
    cpu = host_cpu()
    config = VnniConfig(n_tiles=4, prefetch=32)
    spec = GroupedMatmul("int4", "float32", group_size=128, experts=64, top_k=8, activation_quant="int8")
    top_8 = TEMPLATE.work(spec, 1536, 2048, 1, config, cpu).dram_bytes
    top_1 = TEMPLATE.work(GroupedMatmul("int4", "float32", group_size=128, experts=64, top_k=1,
                                        activation_quant="int8"), 1536, 2048, 1, config, cpu).dram_bytes
    assert 7.5 < top_8 / top_1 < 8.5
    assert TEMPLATE.configs(spec, 1536, 2048, (1, 1), cpu, None)


def _check_output_stage(spec, weight, bias, kernel, x, indices, weights=None):
    """The kernel's y with SwiGLU and/or the weighted top-k sum within the VNNI kernels' bound, carried through."""
    y = kernel(x, pack(weight), bias, indices=indices, weights=weights)
    magnitudes = vnni_magnitudes(weight).view(spec.experts, -1, K)
    assert_grouped_output_within_bound(spec, weight, bias, y, x, indices, weights, magnitudes, 1e-5)


@pytest.mark.parametrize("epilogue, combine", OUTPUT_STAGES)
@pytest.mark.parametrize("dtype, zero_mode, group", TYPES)
def test_every_type_with_swiglu_and_the_weighted_sum(dtype, zero_mode, group, epilogue, combine):
    spec, weight, bias = _case(dtype, zero_mode, group, top_k=2, epilogue=epilogue, combine=combine)
    assert TEMPLATE.unsupported(spec, N_SWIGLU, K, host_cpu()) is None
    kernel = _build(spec, LEVELS[-1], VnniConfig(n_tiles=2, rows=2, prefetch=16))
    for tokens in (1, 2, 5):
        indices = _distinct(tokens, 2, E, tokens)
        x, weights = _routed_inputs(spec, tokens, indices, tokens)
        _check_output_stage(spec, weight, bias, kernel, x, indices, weights)


@pytest.mark.parametrize("epilogue, combine", OUTPUT_STAGES)
def test_output_stages_for_top_k_one_to_eight_any_routing_and_non_finite_x(epilogue, combine):
    """Top-k 1..8 (one kernel each: 2 or 4 tiles, at once or in turn, blocks of 1, 2 or 4 rows), then fuzzed routings
    with repeats, experts no token picks and one expert taking every token, then a NaN in one pair's row: that token's
    outputs are NaN where it reaches them, the others' as before."""
    for top_k in range(1, 9):
        activation = ("bfloat16", "float16", "float32")[top_k % 3]
        spec, weight, bias = _case("int4", None, 64, top_k, activation, experts=8, seed=top_k, epilogue=epilogue,
                                   combine=combine)
        rows = (1, 2, 4)[top_k % 3]
        config = VnniConfig(n_tiles=2 if rows == 4 else 2 + top_k % 2 * 2, rows=rows, prefetch=32 * (top_k % 2),
                            in_turn=top_k % 4 == 0)
        kernel = _build(spec, LEVELS[0], config)
        for tokens in (1, 3):
            indices = _distinct(tokens, top_k, 8, top_k)
            x, weights = _routed_inputs(spec, tokens, indices, top_k)
            _check_output_stage(spec, weight, bias, kernel, x, indices, weights)
    spec, weight, bias = _case("uint4", "gptq", 64, 3, epilogue=epilogue, combine=combine)
    kernel = _build(spec, LEVELS[-1], VnniConfig(n_tiles=2, rows=4, prefetch=16))
    routings = routings_of_three()
    for trial, indices in enumerate(routings):
        x, weights = _routed_inputs(spec, indices.shape[0], indices, trial)
        _check_output_stage(spec, weight, bias, kernel, x, indices if trial % 2 else indices.int(), weights)
    indices = routings[1]
    x, weights = _routed_inputs(spec, 2, indices, 0)
    x[1, 9] = float("nan")  # token 0's second pair (combined), or token 1's row
    y = kernel(x, pack(weight), bias, indices=indices, weights=weights)
    reference = spec.exact(x, weight, indices, bias, weights)
    nan_token = 0 if combine else 1
    assert torch.equal(torch.isnan(y), torch.isnan(reference)) and bool(torch.isnan(y[nan_token]).all())
    assert bool(torch.isfinite(y[1 - nan_token]).all())
