"""The FMA template (integer codes converted to float32 and multiplied in by FMA): every integer type and zero mode it
serves against the float64 reference, for few rows and for blocks of rows (prompts), at every level that runs it
here (AVX2 forced on AVX-512 machines), with the lookup kernel's output stage (its norm prologue:
test_norm_prologue; non-finite x: test_nonfinite and here); the types it refuses, and the tuner's use of it."""

import pytest
import torch

import bitkern
from bitkern.codegen import build_kernel, pack
from bitkern.codegen.cpu import isa
from bitkern.codegen.cpu.fma import TEMPLATE, FmaConfig
from bitkern.ops import Matmul
from bitkern.tuner import host_cpu
from bitkern.tuner.space import enumerate_candidates, usable_templates
from tests.helpers import assert_epilogue_matches_reference, assert_matches_reference, matmul_case

K = 320  # 10 words of 4-bit codes, 5 groups of 64
# the levels this CPU runs that have the template's features (the others' code: test_isa_levels)
LEVELS = [level.name for level in isa.LEVELS if TEMPLATE.runs_at(level) and level.runs_on(
    host_cpu().level.features)]


# Blocks of rows with small prologue chunks: whole and partial blocks, several chunks, a partial last chunk
ROW_BLOCKS = [FmaConfig(n_tiles=1, prefetch=0, rows=6, m_chunk=12), FmaConfig(n_tiles=2, prefetch=32, rows=3, m_chunk=6)]


# the widths blocks of rows serve at: 256-bit (AVX2) and 512-bit vectors without AVX512-BF16, where this CPU runs them
BLOCK_LEVELS = [level for level in LEVELS if level in ("x86-64-v3", "avx512")]


def _device(level: str):
    return host_cpu().at_level(level)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype, zero_mode", [("int4", None), ("uint4", None), ("uint4", "gptq"), ("uint4", "awq"),
                                              ("uint4", "hqq"), ("int8", None), ("uint8", "gptq"), ("int2", None),
                                              ("uint2", "gptq"), ("uint1", None), ("int3", None)])
@pytest.mark.parametrize("activation", ["bfloat16", "float32", "float16"])
def test_integer_codes_match_the_reference(level, dtype, zero_mode, activation):
    device = _device(level)
    spec, q, _, bias = matmul_case(dtype, 48, K, 1, activation, group=64, zero_mode=zero_mode, bias=True)
    reason = TEMPLATE.unsupported(spec, 48, K, device)
    if dtype in ("int3", "uint1"):
        assert reason == f"{dtype[-1]}-bit codes (it reads [2, 4, 8]-bit codes and bfloat16)"
        return
    assert reason is None
    kernel = build_kernel(spec, 48, K, "fma", FmaConfig(n_tiles=2, prefetch=16), "tile16", (1, 4), device)
    packed = pack(q)
    for m in (1, 2, 3, 4):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)) * 10.0 ** (m - 2)  # magnitudes 0.1 to 100
        x = x.to(getattr(torch, activation))
        assert_matches_reference(spec, q, x, bias, kernel(x, packed, bias))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", ["nf4", "mxfp4", "fp4_e2m1", "bnb_fp4", "nvfp4"])
def test_4_bit_code_books_are_looked_up(level, dtype):
    """Code-book codes through the value table: few rows and blocks of rows (where the level takes them) against the
    float64 reference."""
    device = _device(level)
    group = {"mxfp4": 32, "nvfp4": 16}.get(dtype, 64)
    spec, q, _, bias = matmul_case(dtype, 48, K, 1, "bfloat16", group=group, bias=True)
    assert TEMPLATE.unsupported(spec, 48, K, device) is None
    packed = pack(q)
    cases = [(FmaConfig(n_tiles=2, prefetch=16), (1, 4), (1, 3))]
    if level in BLOCK_LEVELS:
        cases.append((ROW_BLOCKS[1], (17, 128), (17, 26)))
    for config, bucket, rows in cases:
        kernel = build_kernel(spec, 48, K, "fma", config, "tile16", bucket, device)
        for m in rows:
            x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).bfloat16()
            assert_matches_reference(spec, q, x, bias, kernel(x, packed, bias))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("activation", ["bfloat16", "float32"])
def test_bfloat16_weights_match_the_reference(level, activation):
    """bfloat16 weights (each k of a word moved into float32's top half) with values over many binades, including
    subnormals and zeros of both signs, few rows and blocks of rows (where the level takes them) against the float64
    reference."""
    device = _device(level)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(48, K, generator=generator) * torch.exp2(torch.randint(-20, 20, (48, K), generator=generator))
    weight[0, :4] = torch.tensor([0.0, -0.0, 1e-40, -3e-39])
    q = bitkern.quantize(weight, "bfloat16", group_size=-1)
    spec = Matmul.for_weight(q, activation, bias=True, output_dtype="float32")
    bias = torch.randn(48, generator=generator)
    assert TEMPLATE.unsupported(spec, 48, K, device) is None
    few_rows = build_kernel(spec, 48, K, "fma", FmaConfig(n_tiles=2, prefetch=16), "tile16", (1, 4), device)
    cases = [(few_rows, (1, 2, 4))]
    if level in BLOCK_LEVELS:
        cases.append((build_kernel(spec, 48, K, "fma", ROW_BLOCKS[0], "tile16", (17, 128), device), (17, 30)))
    for kernel, rows in cases:
        for m in rows:
            x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).to(getattr(torch, activation))
            assert_matches_reference(spec, q, x, bias, kernel(x, pack(q), bias))


def test_other_float_codes_are_refused():
    spec, *_ = matmul_case("float8_e4m3", 48, K, 1, group=64)
    assert TEMPLATE.unsupported(spec, 48, K, host_cpu()) == \
        "float8_e4m3 codes (it converts integer codes and looks up 4-bit code books)"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("epilogue, residual", [("silu", False), ("swiglu", True), ("gelu", True)])
def test_output_stage(level, epilogue, residual):
    device = _device(level)
    generator = torch.Generator().manual_seed(7)
    qweight = bitkern.quantize(torch.randn(64, K, generator=generator), "uint4", group_size=64, zero_mode="gptq")
    spec = Matmul.for_weight(qweight, "bfloat16", bias=True, output_dtype="float32", epilogue=epilogue,
                             residual=residual)
    bias = torch.randn(64, generator=generator)
    kernel = build_kernel(spec, 64, K, "fma", FmaConfig(n_tiles=2, prefetch=0), "tile16", (1, 4), device)
    for m in (1, 4):
        x = torch.randn(m, K, generator=generator).bfloat16()
        r = torch.randn(m, spec.out_features(64), generator=generator) if residual else None
        assert_epilogue_matches_reference(spec, qweight, x, bias, r, kernel(x, pack(qweight), bias, r))


@pytest.mark.parametrize("level", BLOCK_LEVELS)
@pytest.mark.parametrize("dtype, zero_mode, config", [
    ("int4", None, ROW_BLOCKS[0]), ("int4", None, ROW_BLOCKS[1]), ("uint4", "gptq", ROW_BLOCKS[1]),
    ("uint4", "hqq", ROW_BLOCKS[0]), ("int8", None, ROW_BLOCKS[0]), ("int2", None, ROW_BLOCKS[1])])
def test_blocks_of_rows_match_the_reference(level, dtype, zero_mode, config):
    """Prompts: M = 5..40 rows in blocks, every row against the float64 reference (N = 48: a task's second tile
    past N for two tiles a task), and a row with +Inf and one with NaN in a later chunk give torch's pattern."""
    device = _device(level)
    spec, q, _, bias = matmul_case(dtype, 48, K, 1, "bfloat16", group=64, zero_mode=zero_mode, bias=True)
    packed = pack(q)
    for bucket, rows in (((5, 16), (5, 7, 16)), ((17, 128), (17, 40))):
        kernel = build_kernel(spec, 48, K, "fma", config, "tile16", bucket, device)
        for m in rows:
            x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).bfloat16()
            assert_matches_reference(spec, q, x, bias, kernel(x, packed, bias))
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[31, 9], x[38, 100] = float("inf"), float("nan")
    y, exact = kernel(x, packed, bias).double(), spec.exact(x, q, bias)
    assert torch.equal(torch.isnan(y), torch.isnan(exact)) and torch.equal(torch.isinf(y), torch.isinf(exact))
    finite = torch.isfinite(exact).all(dim=1)
    assert_matches_reference(spec, q, x[finite], bias, kernel(x[finite], packed, bias))


@pytest.mark.parametrize("level", BLOCK_LEVELS)
def test_blocks_of_rows_with_the_output_stage(level):
    """SwiGLU with a residual over blocks of rows: as the unfused reference."""
    device = _device(level)
    generator = torch.Generator().manual_seed(5)
    qweight = bitkern.quantize(torch.randn(64, K, generator=generator), "int4", group_size=64)
    spec = Matmul.for_weight(qweight, "bfloat16", bias=True, output_dtype="float32", epilogue="swiglu",
                             residual=True)
    bias = torch.randn(64, generator=generator)
    kernel = build_kernel(spec, 64, K, "fma", FmaConfig(n_tiles=2, prefetch=0, rows=3, m_chunk=6), "tile16",
                          (17, 128), device)
    x = torch.randn(23, K, generator=generator).bfloat16()
    r = torch.randn(23, spec.out_features(64), generator=generator)
    assert_epilogue_matches_reference(spec, qweight, x, bias, r, kernel(x, pack(qweight), bias, r))


def test_the_tuner_offers_it_for_integer_codes():
    """At every row count without AVX512-BF16; with it, few rows only (the dot template serves prompts)."""
    spec, *_ = matmul_case("int4", 64, K, 1, group=64)
    v3 = host_cpu().at_level("x86-64-v3")
    for bucket in ((1, 1), (5, 16), (129, 2**31 - 1)):
        usable, _ = usable_templates(spec, 64, K, bucket, "tile16", v3)
        assert TEMPLATE in usable
    _, candidates = enumerate_candidates(spec, 64, K, (17, 128), "tile16", v3)
    blocks = [c.config for c in candidates if c.template == "fma"]
    assert {(c.n_tiles, c.rows) for c in blocks} == {(1, 2), (1, 3), (1, 4), (1, 6), (2, 2)}
    assert all(c.m_chunk % c.rows == 0 for c in blocks)
    _, unused = usable_templates(spec, 64, K, (5, 16), "tile16", host_cpu().at_level("avx512-bf16"))
    assert unused["fma"] == "16 rows with AVX512-BF16 (the dot template serves them)"
    _, unused = usable_templates(spec, 64, K, (1, 1), "tile16", host_cpu().at_level("x86-64"))
    assert "the x86-64 level (it needs" in unused["fma"]


def test_configurations_of_blocks_are_checked():
    with pytest.raises(ValueError, match="m_chunk a multiple of rows"):
        FmaConfig(n_tiles=1, rows=4, m_chunk=10)
    with pytest.raises(ValueError, match="both 0"):
        FmaConfig(n_tiles=1, rows=4)
    spec, *_ = matmul_case("int4", 64, K, 1, group=64)
    with pytest.raises(ValueError, match="serves at most 4 rows"):
        build_kernel(spec, 64, K, "fma", FmaConfig(n_tiles=1), "tile16", (5, 16), host_cpu().at_level("x86-64-v3"))
