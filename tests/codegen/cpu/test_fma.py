"""The FMA template (integer codes converted to float32 and multiplied in by FMA, few rows): every integer type and
zero mode it serves against the float64 reference, at every level that runs it here (AVX2 forced on AVX-512
machines), with the lookup kernel's output stage (its norm prologue: test_norm_prologue; non-finite x:
test_nonfinite); the types it refuses, and the tuner's use of it."""

import pytest
import torch

import bitkern
from bitkern.codegen import build_kernel, pack
from bitkern.codegen.cpu import isa
from bitkern.codegen.cpu.fma import TEMPLATE, FmaConfig
from bitkern.ops import Matmul
from bitkern.tuner import host_cpu
from bitkern.tuner.space import usable_templates
from tests.helpers import assert_epilogue_matches_reference, assert_matches_reference, matmul_case

K = 320  # 10 words of 4-bit codes, 5 groups of 64
# the levels this CPU runs that have the template's features (the others' code: test_isa_levels)
LEVELS = [level.name for level in isa.LEVELS if TEMPLATE.requires <= level.features and level.runs_on(
    host_cpu().level.features)]


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
        assert reason == f"{dtype[-1]}-bit codes (it reads [2, 4, 8]-bit codes)"
        return
    assert reason is None
    kernel = build_kernel(spec, 48, K, "fma", FmaConfig(n_tiles=2, prefetch=16), "tile16", (1, 4), device)
    packed = pack(q)
    for m in (1, 2, 3, 4):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)) * 10.0 ** (m - 2)  # magnitudes 0.1 to 100
        x = x.to(getattr(torch, activation))
        assert_matches_reference(spec, q, x, bias, kernel(x, packed, bias))


@pytest.mark.parametrize("dtype", ["nf4", "mxfp4", "fp4_e2m1", "bnb_fp4"])
def test_codes_that_are_not_their_values_go_to_the_lookup_template(dtype):
    spec, *_ = matmul_case(dtype, 48, K, 1, group=32 if dtype == "mxfp4" else 64)
    assert "it converts codes that are their values as integers" in TEMPLATE.unsupported(spec, 48, K, host_cpu())


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


def test_the_tuner_offers_it_for_integer_codes_at_few_rows():
    spec, *_ = matmul_case("int4", 64, K, 1, group=64)
    usable, _ = usable_templates(spec, 64, K, (1, 1), "tile16", host_cpu().at_level("x86-64-v3"))
    assert TEMPLATE in usable
    _, unused = usable_templates(spec, 64, K, (5, 16), "tile16", host_cpu())
    assert "fma" in unused and "serves at most 4" in unused["fma"]
    _, unused = usable_templates(spec, 64, K, (1, 1), "tile16", host_cpu().at_level("x86-64"))
    assert "the x86-64 level (it needs" in unused["fma"]
