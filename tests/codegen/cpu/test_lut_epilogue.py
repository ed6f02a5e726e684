"""The lookup template's output stage: ReLU, SiLU, GELU, the residual add and SwiGLU over a stacked [gate; up]
weight, against the float64 reference of the unfused computation (for every type it serves and each row count
of its range, M = 1..4: it serves no more rows), and the tuner's use of it for such specs."""

import pytest
import torch

import bitkern
from bitkern.codegen import build_kernel, pack
from bitkern.codegen.cpu.lut import TEMPLATE, LutConfig
from bitkern.ops import Matmul
from bitkern.tuner import host_cpu
from bitkern.tuner.space import usable_templates
from tests.helpers import assert_epilogue_matches_reference

K = 256
CASES = [("relu", False, 40), ("silu", False, 64), ("gelu", True, 48), ("none", True, 40), ("swiglu", False, 96),
         ("swiglu", True, 64)]  # (epilogue, residual, N: ragged N takes the lane-by-lane store)


def _case(dtype, epilogue, residual, n, output="float32", activation="bfloat16", zero_mode=None):
    generator = torch.Generator().manual_seed(n + len(epilogue))
    qweight = bitkern.quantize(torch.randn(n, K, generator=generator), dtype, group_size=64, zero_mode=zero_mode)
    spec = Matmul.for_weight(qweight, activation, bias=True, output_dtype=output, epilogue=epilogue,
                             residual=residual)
    return spec, qweight, torch.randn(n, generator=generator), generator


@pytest.mark.parametrize("dtype, zero_mode", [("int4", None), ("nf4", None), ("int2", None), ("uint4", "gptq")])
@pytest.mark.parametrize("epilogue, residual, n", CASES)
def test_fused_output_matches_the_unfused_reference(dtype, zero_mode, epilogue, residual, n):
    spec, qweight, bias, generator = _case(dtype, epilogue, residual, n, zero_mode=zero_mode)
    packed = pack(qweight)
    kernel = build_kernel(spec, n, K, "lut", LutConfig(n_tiles=2, prefetch=16), packed.layout, (1, 4), host_cpu())
    for m in (1, 2, 4):
        x = torch.randn(m, K, generator=generator).bfloat16()
        r = torch.randn(m, spec.out_features(n), generator=generator) if residual else None
        y = kernel(x, packed, bias, r)
        assert_epilogue_matches_reference(spec, qweight, x, bias, r, y)


@pytest.mark.parametrize("activation, output", [("float16", "float16"), ("float32", "bfloat16")])
def test_residual_and_swiglu_in_other_activation_and_output_types(activation, output):
    spec, qweight, bias, generator = _case("int4", "swiglu", True, 64, output, activation)
    packed = pack(qweight)
    kernel = build_kernel(spec, 64, K, "lut", LutConfig(n_tiles=4, prefetch=0), packed.layout, (3, 3), host_cpu())
    x = torch.randn(3, K, generator=generator).to(getattr(torch, activation))
    r = torch.randn(3, 32, generator=generator).to(getattr(torch, output))
    assert_epilogue_matches_reference(spec, qweight, x, bias, r, kernel(x, packed, bias, r))


def test_tuner_offers_it_for_epilogues_with_swiglu_tiles_in_pairs():
    device = host_cpu()
    for epilogue, residual in (("gelu", True), ("swiglu", False)):
        spec, *_ = _case("int4", epilogue, residual, 64)
        usable, unused = usable_templates(spec, 64, K, (1, 1), "tile16", device)
        assert TEMPLATE in usable, unused.get("lut")
        configs = TEMPLATE.configs(spec, 64, K, (1, 4), device, None)
        assert configs and all(c.n_tiles % 2 == 0 for c in configs) == (epilogue == "swiglu")


def test_swiglu_with_an_odd_tile_count_is_refused_before_any_build():
    spec, qweight, _, _ = _case("int4", "swiglu", False, 64)
    with pytest.raises(ValueError, match="n_tiles=1: epilogue='swiglu' needs an even n_tiles"):
        build_kernel(spec, 64, K, "lut", LutConfig(n_tiles=1), "tile16", (1, 4), host_cpu())
