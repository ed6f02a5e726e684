"""The grouped FMA template (`codegen.cpu.grouped`, `emit.grouped`): one launch for rows routed to their top-k of
stacked experts, against the float64 reference (`ops.GroupedMatmul`) for every type the FMA template serves, top-k 1
to 8, experts no row picks, one expert taking every row (more than the four rows of a body), the same expert picked by
several rows, fuzzed routings (seeded, repeats within a row too), biases and partial tile blocks; the output stage's
SwiGLU on each expert's [gate; up] halves and weighted top-k sum (combine) the same way; at every level this CPU runs
(x86-64-v3 forced), compiled to FMA code above it; the tuner and the cache through the spec's call."""

import dataclasses

import pytest
import torch

import bitkern
from bitkern.codegen import build_kernel, pack
from bitkern.codegen.cpu import isa
from bitkern.codegen.cpu.fma import FmaConfig
from bitkern.codegen.cpu.grouped import TEMPLATE
from bitkern.codegen.cpu.kernel import disassembly
from bitkern.ops import GroupedMatmul, Matmul
from bitkern.tuner import host_cpu
from bitkern.tuner.space import usable_templates
from tests.helpers import assert_grouped_output_within_bound, assert_within_bound, summed_magnitudes

E, N, K = 6, 48, 320  # 3 tiles per expert: blocks of 2 tiles leave a partial one
N_SWIGLU = 96  # [gate; up] of 3 tiles each: blocks of 2 (gate, up) pairs leave a partial one
LEVELS = [level.name for level in (*isa.LEVELS, *isa.ARM_LEVELS) if TEMPLATE.runs_at(level) and level.runs_on(
    host_cpu().level.features)]  # on an aarch64 host (the emulated lane), its levels
ABOVE = [level.name for level in isa.LEVELS if TEMPLATE.runs_at(level) and level.arch == "x86_64"
         and level.name not in LEVELS]
# (dtype, zero mode, group): integer codes (symmetric, zero points), 4-bit code books, bfloat16
TYPES = [("int4", None, 64), ("uint4", "gptq", 64), ("uint4", "hqq", 64), ("int8", None, 64), ("uint8", "gptq", 64),
         ("int2", None, 64), ("uint2", "gptq", 64), ("nf4", None, 64), ("fp4_e2m1", None, 64), ("mxfp4", None, 32),
         ("bfloat16", None, 64)]


def _case(dtype, zero_mode, group, top_k, activation="float32", bias=True, experts=E, seed=0, **fields):
    """(spec, the experts' [E·N, K] stacked weight, bias [E, N] or None) of random weights; `fields`: more of the
    spec's.  SwiGLU specs take experts of N_SWIGLU rows."""
    generator = torch.Generator().manual_seed(seed)
    n = N_SWIGLU if fields.get("epilogue") == "swiglu" else N
    weight = bitkern.quantize(torch.randn(experts * n, K, generator=generator), dtype, group_size=group,
                              zero_mode=zero_mode)
    scale = "float16" if weight.ttype.block_size > 1 else weight.scales.dtype
    spec = GroupedMatmul(dtype, activation, group_size=group, zero_mode=weight.zero_mode, bias=bias,
                         scale_dtype=scale, experts=experts, top_k=top_k, **fields)
    b = torch.randn(experts, n, generator=generator) if bias else None
    return spec, weight, b


def _check(spec, weight, bias, kernel, x, indices):
    """The kernel's y for (x, indices) within the dense kernels' bound of the float64 reference, pair by pair."""
    y = kernel(x, pack(weight), bias, indices=indices)
    assert y.shape == (x.shape[0], spec.top_k, N) and y.dtype == getattr(torch, spec.output_dtype)
    magnitudes = summed_magnitudes(spec.matmul, weight).view(spec.experts, N, K)
    magnitude = torch.einsum("mk,mjnk->mjn", x.double().abs(), magnitudes[indices.long()])
    assert_within_bound(spec, weight, y, spec.exact(x, weight, indices, bias), magnitude)


def _build(spec, level, config=FmaConfig(n_tiles=2, prefetch=16), n=None):
    n = n or (N_SWIGLU if spec.epilogue == "swiglu" else N)
    return build_kernel(spec, n, K, "grouped_fma", config, "tile16", (1, 16), host_cpu().at_level(level))


def _distinct(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])


@pytest.mark.parametrize("level", sorted({LEVELS[0], LEVELS[-1]}))
@pytest.mark.parametrize("dtype, zero_mode, group", TYPES)
def test_every_type_matches_the_reference(level, dtype, zero_mode, group):
    spec, weight, bias = _case(dtype, zero_mode, group, top_k=2)
    assert TEMPLATE.unsupported(spec, N, K, host_cpu()) is None
    kernel = _build(spec, level)
    for tokens in (1, 2, 4, 7):
        x = torch.randn(tokens, K, generator=torch.Generator().manual_seed(tokens)) * 10.0 ** (tokens % 3 - 1)
        _check(spec, weight, bias, kernel, x, _distinct(tokens, 2, E, tokens))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("activation", ["bfloat16", "float16", "float32"])
def test_top_k_one_to_eight_at_every_level(level, activation):
    """Eight experts, each token's top-k distinct, k from 1 to 8; one kernel per k."""
    for top_k in range(1, 9):
        spec, weight, bias = _case("int4", None, 64, top_k, activation, experts=8, seed=top_k)
        kernel = _build(spec, level, FmaConfig(n_tiles=1 + top_k % 2, prefetch=32 * (top_k % 2)))
        for tokens in (1, 3):
            x = torch.randn(tokens, K, generator=torch.Generator().manual_seed(top_k)).to(getattr(torch, activation))
            _check(spec, weight, bias, kernel, x, _distinct(tokens, top_k, 8, top_k))


def test_routings_empty_experts_one_expert_for_all_shared_experts_and_fuzzed():
    spec, weight, bias = _case("uint4", "gptq", 64, top_k=2)
    one = dict(zip(("spec", "weight", "bias"), _case("nf4", None, 64, top_k=1)))
    kernel, single = _build(spec, LEVELS[-1]), _build(one["spec"], LEVELS[-1])
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(1))
    # expert 4 takes all 9 rows (three bodies of up to 4 rows), experts 0..3 and 5 none
    _check(one["spec"], one["weight"], one["bias"], single, x, torch.full((9, 1), 4, dtype=torch.int32))
    # expert 2 picked by every token, expert 5 by two of them, the others by none
    _check(spec, weight, bias, kernel, x[:4], torch.tensor([[2, 5], [5, 2], [2, 0], [1, 2]]))
    # a token picking the same expert twice gets the same row twice
    y = kernel(x[:1], pack(weight), bias, indices=torch.tensor([[3, 3]]))
    assert torch.equal(y[0, 0], y[0, 1])
    generator = torch.Generator().manual_seed(7)
    for trial in range(12):  # fuzzed: any expert in any slot, repeats allowed, 1 to 12 tokens, int32 or int64
        tokens = int(torch.randint(1, 13, (1,), generator=generator))
        indices = torch.randint(0, E, (tokens, 2), generator=generator)
        x = torch.randn(tokens, K, generator=generator)
        _check(spec, weight, bias, kernel, x, indices if trial % 2 else indices.int())


def test_without_a_bias_and_with_bfloat16_output():
    spec, weight, _ = _case("int8", None, 64, top_k=3, activation="bfloat16", bias=False)
    kernel = _build(spec, LEVELS[0])
    x = torch.randn(2, K).bfloat16()
    _check(spec, weight, None, kernel, x, _distinct(2, 3, E, 3))


@pytest.mark.parametrize("level", ABOVE)
@pytest.mark.parametrize("epilogue, combine", [("none", False), ("swiglu", True)])
def test_levels_above_this_cpu_compile_to_fma_code(level, epilogue, combine):
    spec, _, _ = _case("int4", None, 64, top_k=2, epilogue=epilogue, combine=combine)
    kernel = build_kernel(spec, N_SWIGLU if combine else N, K, "grouped_fma", FmaConfig(2, 16), "tile16", (1, 16),
                          host_cpu().at_level(level))
    code = disassembly(kernel.library)
    assert "vfmadd" in code and "vcvtdq2ps" in code


def test_the_tuner_offers_it_for_grouped_specs_only_and_the_cache_serves_it():
    spec, weight, bias = _case("int4", None, 64, top_k=2)
    usable, unused = usable_templates(spec, N, K, (1, 1), "tile16", host_cpu())
    assert [t.name for t in usable] == ["grouped_fma"]
    assert unused["fma"] == "a grouped spec (rows routed to experts)"
    dense = usable_templates(Matmul("int4", "float32", group_size=64), N, K, (1, 1), "tile16", host_cpu())[1]
    assert dense["grouped_fma"] == "a spec of one weight (the grouped FMA template routes rows to experts)"
    nvfp4 = GroupedMatmul("nvfp4", "float32", group_size=16, experts=E, top_k=2)
    assert "a scale per tensor" in usable_templates(nvfp4, N, K, (1, 1), "tile16", host_cpu())[1]["grouped_fma"]
    x = torch.randn(3, K)
    indices = _distinct(3, 2, E, 0)
    y = spec(x, pack(weight), indices, bias)  # the dispatch: tuned (or loaded) through the cache
    magnitudes = summed_magnitudes(spec.matmul, weight).view(E, N, K)
    assert_within_bound(spec, weight, y, spec.exact(x, weight, indices, bias),
                        torch.einsum("mk,mjnk->mjn", x.double().abs(), magnitudes[indices]))
    with pytest.raises(ValueError, match="indices holds expert ids outside"):
        spec(x, pack(weight), indices + E, bias)
    assert spec(x[:0], pack(weight), indices[:0], bias).shape == (0, 2, N)


def test_the_tuner_times_candidates_on_experts_it_has_not_read_before():
    """Timing rotates windows of one random stack, each starting past the experts the one before had routed to, so
    each call reads its experts from DRAM; the profiled tuner picks a grouped kernel."""
    from bitkern.tuner import tune
    from bitkern.tuner.profile import inputs, profile_bytes, stage_inputs

    spec = GroupedMatmul("int4", "float32", group_size=64, experts=E, top_k=2)
    device = host_cpu()
    _, copies, _ = inputs(spec, N, K, 2, "tile16", device)
    assert stage_inputs(spec, N, K, 2, device)["indices"].tolist() == [[0, 1], [2, 3]]
    assert len(copies) >= 2 and all(copy.shape == (E * N, K) for copy in copies)
    expert_bytes = (N // 16) * copies[0].qweight.stride(0) * 4
    assert copies[1].qweight.data_ptr() - copies[0].qweight.data_ptr() == 4 * expert_bytes  # past the 4 routed
    assert len(copies) * 4 * (expert_bytes + copies[0].scales[:N // 16].nbytes) >= profile_bytes(device) * 0.9
    tuned = tune(spec, N, K, (1, 4), "tile16", device, top_k=2)
    assert tuned.record.profiled and tuned.kernel.template == "grouped_fma"


def test_the_model_ranks_two_tiles_a_task_first_at_decode():
    """x's broadcast serves a task's n_tiles tiles: at a MoE decode step's shapes (64 experts of 768, hidden 2048,
    top-8) the model's best configuration takes more than 1 tile a task, as timing on Zen 5 does (4 tiles, which
    AVX-512's registers hold: 0.6-0.7x the time of 1) and on Zen 4 (weights rotating through DRAM, 2 threads: 4 tiles
    0.56 ms against 0.87 for 1 at top-8, M=1; 0.31 against 0.47 at top-1, M=8)."""
    from bitkern.tuner.cost import estimate

    cpu = host_cpu()
    for (n, k), m, top_k in (((1536, 2048), 1, 8), ((2048, 768), 8, 1)):
        spec = GroupedMatmul("int4", "float32", group_size=128, experts=64, top_k=top_k)
        configs = TEMPLATE.configs(spec, n, k, (m, m), cpu, None)
        best = min(configs, key=lambda config: estimate("grouped_fma", config, spec, n, k, m, cpu).seconds)
        assert best.n_tiles > 1, (n, k, best)


AVX512 = [level for level in LEVELS if isa.level(level).vector_bytes == 64]


@pytest.mark.skipif(not AVX512, reason="needs an AVX-512 CPU")
@pytest.mark.parametrize("dtype, zero_mode, group", [("int4", None, 64), ("nf4", None, 64), ("uint8", "gptq", 64)])
def test_four_tiles_a_task_where_the_registers_hold_them(dtype, zero_mode, group):
    """AVX-512 is offered 4 tiles a task (AVX2 is not: its sums would spill); 3 tiles per expert leave the block
    partial.  Every row count 1..4 per expert, top-k 1..8, against the float64 reference."""
    offered = {config.n_tiles for config in TEMPLATE.configs(*_case(dtype, zero_mode, group, 1)[:1], N, K, (1, 1),
                                                               host_cpu().at_level(AVX512[-1]), None)}
    assert offered == {1, 2, 4}
    for top_k in (1, 3, 8):
        spec, weight, bias = _case(dtype, zero_mode, group, top_k, experts=8, seed=top_k)
        kernel = _build(spec, AVX512[-1], FmaConfig(n_tiles=4, prefetch=32))
        for tokens in (1, 2, 4):
            x = torch.randn(tokens, K, generator=torch.Generator().manual_seed(tokens))
            _check(spec, weight, bias, kernel, x, _distinct(tokens, top_k, 8, tokens))


OUTPUT_STAGES = [("swiglu", False), ("none", True), ("swiglu", True)]  # (epilogue, combine)


def _check_output_stage(spec, weight, bias, kernel, x, indices, weights=None):
    """The kernel's y with SwiGLU and/or the weighted top-k sum within the bound of the float64 reference."""
    y = kernel(x, pack(weight), bias, indices=indices, weights=weights)
    c = 1e-5 if "bfloat16" in weight.ttype.compute_types else 2.0**-8
    magnitudes = summed_magnitudes(spec.matmul, weight).view(spec.experts, -1, K)
    assert_grouped_output_within_bound(spec, weight, bias, y, x, indices, weights, magnitudes, c)


def routings_of_three() -> list:
    """Top-3 routings of E experts: one expert taking all 9 tokens (the others none), an expert picked twice by a
    token, then 8 fuzzed ones of 1 to 10 tokens (any expert in any slot, repeats allowed)."""
    generator = torch.Generator().manual_seed(11)
    routings = [torch.full((9, 3), 4), torch.tensor([[2, 2, 5], [5, 2, 2]])]
    return routings + [torch.randint(0, E, (int(torch.randint(1, 11, (1,), generator=generator)), 3),
                                     generator=generator) for _ in range(8)]


def _routed_inputs(spec, tokens: int, indices, seed: int):
    """(x, weights) of `tokens` tokens: x a row per token, or per (token, expert) pair where the spec combines; the
    routing weights positive, summing to 1 per token (a router's softmax), or None."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens * spec.top_k if spec.combine else tokens, K, generator=generator)
    weights = torch.rand(tokens, spec.top_k, generator=generator).softmax(-1) if spec.combine else None
    return x.to(getattr(torch, spec.activation_dtype)), weights


@pytest.mark.parametrize("epilogue, combine", OUTPUT_STAGES)
@pytest.mark.parametrize("dtype, zero_mode, group", TYPES)
def test_every_type_with_swiglu_and_the_weighted_sum(dtype, zero_mode, group, epilogue, combine):
    spec, weight, bias = _case(dtype, zero_mode, group, top_k=2, epilogue=epilogue, combine=combine)
    assert TEMPLATE.unsupported(spec, N, K, host_cpu()) is None
    kernel = _build(spec, LEVELS[-1])
    for tokens in (1, 2, 5):
        indices = _distinct(tokens, 2, E, tokens)
        x, weights = _routed_inputs(spec, tokens, indices, tokens)
        _check_output_stage(spec, weight, bias, kernel, x, indices, weights)


@pytest.mark.parametrize("epilogue, combine", OUTPUT_STAGES)
def test_output_stages_for_top_k_one_to_eight_and_any_routing(epilogue, combine):
    """Top-k 1..8 (one kernel each, 1 to 4 tiles a task), then fuzzed routings with repeats, experts no token picks
    and one expert taking every token, bfloat16 activations and output, at the lowest level this CPU runs."""
    for top_k in range(1, 9):
        spec, weight, bias = _case("int4", None, 64, top_k, "bfloat16", experts=8, seed=top_k, epilogue=epilogue,
                                   combine=combine)
        kernel = _build(spec, LEVELS[0], FmaConfig(n_tiles=2 * (1 + top_k % 2), prefetch=16 * (top_k % 3)))
        for tokens in (1, 3):
            indices = _distinct(tokens, top_k, 8, top_k)
            x, weights = _routed_inputs(spec, tokens, indices, top_k)
            _check_output_stage(spec, weight, bias, kernel, x, indices, weights)
    spec, weight, bias = _case("uint4", "gptq", 64, 3, epilogue=epilogue, combine=combine)
    kernel = _build(spec, LEVELS[0])
    for trial, indices in enumerate(routings_of_three()):
        x, weights = _routed_inputs(spec, indices.shape[0], indices, trial)
        _check_output_stage(spec, weight, bias, kernel, x, indices if trial % 2 else indices.int(), weights)


def test_swiglu_and_the_weighted_sum_compose_as_the_plain_kernel_and_torch():
    """The fused kernel against the plain one (same configuration) with SwiGLU on the halves and the weighted sum done
    in torch: equal within float32 rounding."""
    spec, weight, bias = _case("nf4", None, 64, 4, epilogue="swiglu", combine=True)
    plain_spec = dataclasses.replace(spec, epilogue="none", combine=False, top_k=1)
    fused, plain = _build(spec, LEVELS[-1]), _build(plain_spec, LEVELS[-1], n=N_SWIGLU)
    indices = _distinct(3, 4, E, 5)
    x, weights = _routed_inputs(spec, 3, indices, 5)
    z = plain(x, pack(weight), bias, indices=indices.reshape(-1, 1)).view(3, 4, N_SWIGLU)
    gate, up = z.chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up * weights.unsqueeze(-1)).sum(1)
    assert torch.allclose(fused(x, pack(weight), bias, indices=indices, weights=weights), expected, rtol=1e-5,
                          atol=1e-5 * float(expected.abs().max()))


def test_the_output_stages_are_offered_and_refused_by_name():
    """The grouped templates serve SwiGLU and the weighted sum (SwiGLU in tile pairs); other epilogues are refused by
    the spec; an odd number of tiles a task is not offered for SwiGLU."""
    spec, weight, bias = _case("int4", None, 64, 2, epilogue="swiglu", combine=True)
    configs = TEMPLATE.configs(spec, N, K, (1, 1), host_cpu(), None)
    assert configs and all(config.n_tiles % 2 == 0 for config in configs)
    with pytest.raises(ValueError, match="needs an even n_tiles"):
        _build(spec, LEVELS[0], FmaConfig(n_tiles=1, prefetch=0))
    with pytest.raises(ValueError, match="epilogue='gelu'"):
        GroupedMatmul("int4", "float32", experts=E, top_k=2, epilogue="gelu")
    x, weights = _routed_inputs(spec, 2, None, 0)
    indices = _distinct(2, 2, E, 0)
    y = spec(x, pack(weight), indices, bias, weights)  # through the tuner and the cache
    assert y.shape == (2, N_SWIGLU // 2)
    with pytest.raises(ValueError, match="weights are required"):
        spec(x, pack(weight), indices, bias)
    with pytest.raises(ValueError, match="a multiple of top_k=2"):
        spec(x[:3], pack(weight), indices, bias, weights)
    assert spec(x[:0], pack(weight), indices[:0], bias, weights[:0]).shape == (0, N_SWIGLU // 2)
