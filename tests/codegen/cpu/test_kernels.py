"""Compiled CPU kernels (AMX, AVX512-BF16, lookup and generic templates) against the float64 reference of
bitkern.ops."""

import dataclasses
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bitkern
from bitkern import ttype
from bitkern.cache import kernel_for
from bitkern.codegen import PackedWeight, pack, to_layout
from bitkern.codegen.cpu.kernel import disassembly
from bitkern.ops import Matmul
from bitkern.tuner import host_cpu
from tests.helpers import MATRIX_TEMPLATES, assert_matches_reference, matmul_case, matrix_device

def _run(spec, qweight, x, bias=None):
    y = spec(x, pack(qweight), bias)
    assert_matches_reference(spec, qweight, x, bias, y)
    return y


WEIGHT_TYPES = ["int8", "uint8", "int4", "uint4", "int3", "uint3", "int2", "uint2", "int1", "uint1", "nf4",
                "fp4_e2m1", "float8_e4m3", "float8_e5m2", "mxfp8", "mxfp4", "nvfp4", "bfloat16"]


@pytest.mark.parametrize("name", WEIGHT_TYPES)
@pytest.mark.parametrize("activation, m", [("bfloat16", 1), ("bfloat16", 33), ("float16", 5), ("float32", 2)])
def test_every_weight_type_with_every_activation_type(name, activation, m):
    block = ttype.get(name).block_size > 1
    _run(*matmul_case(name, 96, 256, m, activation, group=None if block else 128)[:3])


@pytest.mark.parametrize("name", ["int4", "int3"])
@pytest.mark.parametrize("activation", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("output", ["float32", "float16", "bfloat16"])
def test_activation_and_output_types(name, activation, output):
    spec, q, x, b = matmul_case(name, 48, 192, 5, activation, output, group=64, bias=True)
    _run(spec, q, x, b)


@pytest.mark.parametrize("name", ["uint4", "uint2"])
@pytest.mark.parametrize("zero_mode", ["gptq", "awq", "hqq"])
@pytest.mark.parametrize("activation", ["bfloat16", "float32"])
def test_zero_point_conventions(name, zero_mode, activation):
    _run(*matmul_case(name, 64, 256, 3, activation, group=64, zero_mode=zero_mode)[:3])


@pytest.mark.parametrize("group", [32, 64, 256, -1])
@pytest.mark.parametrize("m", [2, 40])
def test_group_sizes(group, m):
    spec, q, x, b = matmul_case("int4", 80, 512, m, group=group, bias=True)
    _run(spec, q, x, b)


@pytest.mark.parametrize("name, scale_dtype", [("int4", torch.bfloat16), ("uint4", torch.float32)])
def test_scale_storage_dtypes(name, scale_dtype):
    q = bitkern.quantize(torch.randn(32, 128), name, group_size=64, scale_dtype=scale_dtype)
    spec = Matmul.for_weight(q, "float32")
    assert spec.scale_dtype == {torch.bfloat16: "bfloat16", torch.float32: "float32"}[scale_dtype]
    _run(spec, q, torch.randn(3, 128))


@pytest.mark.parametrize("name", ["int4", "int8", "uint4"])
def test_int8_activations(name):
    _run(*matmul_case(name, 64, 256, 4, "int8", zero_mode="gptq" if name == "uint4" else None)[:3])


FUZZED_TYPES = [t for t in WEIGHT_TYPES if ttype.get(t).block_size == 1]
UNSIGNED = [t for t in FUZZED_TYPES if ttype.get(t).kind == "uint"]


@st.composite
def fuzzed_cases(draw):
    """A weight type, activation/output types, zero mode, group size and odd shape (N, K, M down to 1)."""
    name = draw(st.sampled_from(FUZZED_TYPES))
    zero_mode = draw(st.sampled_from(["gptq", "awq", "hqq"])) if name in UNSIGNED else None
    group = draw(st.sampled_from([-1, -1, 8, 16, 32, 64, 128]))
    k = draw(st.integers(1, 300))
    if group != -1:
        k = group * -(-k // group)
    n = draw(st.integers(1, 97))
    m = draw(st.one_of(st.integers(1, 4), st.sampled_from([2, 3, 5, 7, 13, 17, 31, 131]), st.integers(1, 150)))
    activation = draw(st.sampled_from(["bfloat16", "bfloat16", "float16", "float32"]))
    output = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    return name, n, k, m, activation, output, group, zero_mode, draw(st.booleans()), draw(st.integers(0, 1000))


@settings(max_examples=120, deadline=None)
@given(case=fuzzed_cases())
def test_fuzzed_shapes_and_types(case):
    """120 random (type, zero mode, group, N, K, M, activation, output, bias) cases: one kernel build each."""
    name, n, k, m, activation, output, group, zero_mode, bias, seed = case
    _run(*matmul_case(name, n, k, m, activation, output, group=group, zero_mode=zero_mode, bias=bias, seed=seed))


@pytest.mark.parametrize("name, m", [("int4", 1), ("nf4", 9), ("uint2", 40), ("int1", 200), ("int3", 3), ("int8", 2)])
def test_results_are_bitwise_deterministic(name, m):
    spec, q, x, b = matmul_case(name, 160, 512, m, bias=True)
    packed = pack(q)
    first = spec(x, packed, b)
    assert all(torch.equal(first, spec(x, packed, b)) for _ in range(5))


def test_batched_strided_and_empty_inputs():
    """A contiguous [M, K] x goes to the kernel as it is; batched and strided ones are flattened first."""
    spec, q, _, _ = matmul_case("int4", 32, 128, 1)
    x = torch.randn(2, 3, 128).bfloat16()
    _run(spec, q, x)
    _run(spec, q, torch.randn(128, 3).bfloat16().T)
    assert spec(torch.empty(0, 128, dtype=torch.bfloat16), pack(q)).shape == (0, 32)


def test_user_defined_types_run_in_kernels():
    cb4 = ttype.register(ttype.codebook("kernel_cb4", [i / 8 - 1 for i in range(16)]))
    cb3 = ttype.register(ttype.codebook("kernel_cb3", [-1, -0.5, -0.2, 0, 0.15, 0.4, 0.7, 1]))
    int5 = ttype.register(ttype.integer("kernel_int5", 5))
    fp6 = ttype.register(ttype.floating("kernel_fp6", 3, 2))
    for t in (cb4, cb3, int5, fp6):
        _run(*matmul_case(t.name, 48, 128, 3, group=64)[:3])


@pytest.mark.parametrize("template", MATRIX_TEMPLATES)
def test_matrix_and_generic_templates_agree(template):
    from bitkern.codegen import build_kernel
    from bitkern.codegen.cpu.generic import GenericConfig

    spec, q, x, _ = matmul_case("fp4_e2m1", 64, 256, 7, "float32")  # table-decoded, exact in bf16 (nf4 is not: generic)
    packed = pack(q)
    matrix_kernel = kernel_for(spec, 64, 256, 7, packed.layout, matrix_device(template))
    assert matrix_kernel.template == template
    generic_kernel = build_kernel(spec, 64, 256, "generic", GenericConfig(), packed.layout, (1, 16), host_cpu())
    assert_matches_reference(spec, q, x, None, matrix_kernel(x, packed))
    assert_matches_reference(spec, q, x, None, generic_kernel(x, packed))


def _spread(candidates):
    """The smallest and largest-tile candidate of each (template, decode, tile shape, prologue) family."""
    families = {}
    for c in candidates:
        key = (c.template, getattr(c.config, "decode", None), getattr(c.config, "m_tiles", None),
               getattr(c.config, "chunk_prologue", None))
        families.setdefault(key, []).append(c)
    return [c for family in families.values() for c in {family[0].config: family[0], family[-1].config: family[-1]}.values()]


@pytest.mark.parametrize("template", MATRIX_TEMPLATES)
@pytest.mark.parametrize("name, activation, zero_mode, group, m, bucket", [
    ("int4", "bfloat16", None, 128, 3, (1, 4)), ("fp4_e2m1", "float32", None, 64, 11, (5, 16)),
    ("int8", "bfloat16", None, 128, 3, (1, 4)), ("uint8", "bfloat16", "hqq", 64, 40, (17, 128)),
    ("uint2", "float16", "gptq", 128, 40, (17, 128)), ("int1", "bfloat16", None, -1, 130, (129, 1 << 30)),
    ("uint8", "float16", "awq", 64, 7, (5, 16)), ("int8", "float32", None, -1, 40, (17, 128)),
    ("bfloat16", "bfloat16", None, -1, 3, (1, 4)), ("bfloat16", "float32", None, 128, 40, (17, 128))])
def test_every_kind_of_tuner_candidate_computes_the_reference(name, activation, zero_mode, group, m, bucket,
                                                              template):
    """The tuner may pick any candidate, so each family of the space (templates, decodes, small/large-M
    tiles, 8-bit nibble planes or converted 8-bit codes) must be correct, not only the one the model ranks
    first."""
    from bitkern.codegen import build_kernel
    from bitkern.tuner.space import enumerate_candidates

    cpu = matrix_device(template)
    spec, q, x, b = matmul_case(name, 96, 256, m, activation, group=group, zero_mode=zero_mode, bias=True)
    packed = pack(q)
    hint, candidates = enumerate_candidates(spec, 96, 256, bucket, packed.layout, cpu)
    chosen = _spread([c for c in candidates if c.template != "generic"])
    assert {c.template for c in chosen} >= {template}
    for candidate in chosen:
        kernel = build_kernel(spec, 96, 256, candidate.template, candidate.config, packed.layout, bucket, cpu)
        assert_matches_reference(spec, q, x, b, kernel(x, packed, b))


@pytest.mark.parametrize("name, activation, zero_mode, group, m, config", [
    ("int4", "bfloat16", None, 128, 13, dict(n_tiles=3, rows=4, stage_steps=2)),      # last block repeats a tile
    ("uint4", "float32", "gptq", 64, 16, dict(n_tiles=1, rows=16, stage_steps=1, decode="lut")),
    ("int8", "bfloat16", None, 32, 5, dict(n_tiles=1, rows=8, stage_steps=1)),       # two nibble planes
    ("nf4", "bfloat16", None, -1, 40, dict(n_tiles=2, rows=4, stage_steps=2, small_m=False, m_chunk=32,
                                            decode="lut")),                          # C stashed between stages
    ("uint2", "float16", "hqq", 16, 70, dict(n_tiles=4, rows=2, stage_steps=1, small_m=False, m_chunk=64,
                                             decode="lut")),
    ("int1", "float32", None, 128, 131, dict(n_tiles=2, rows=2, stage_steps=4, small_m=False, m_chunk=32,
                                             decode="lut", chunk_prologue=True)),
    ("nvfp4", "bfloat16", None, 16, 3, dict(n_tiles=2, rows=1, stage_steps=2, decode="lut")),
    ("int4", "bfloat16", None, 128, 3, dict(n_tiles=3, rows=2, stage_steps=2, direct=True)),  # bodies for 2, then 1
    ("fp4_e2m1", "float32", None, 64, 4, dict(n_tiles=2, rows=4, stage_steps=1, decode="lut", direct=True)),
    ("uint8", "bfloat16", "awq", -1, 1, dict(n_tiles=1, rows=1, stage_steps=4, direct=True)),
    ("int1", "bfloat16", None, 128, 2, dict(n_tiles=1, rows=2, stage_steps=2, direct=True)),  # 4 and 8 splits
    ("int8", "float16", None, 64, 9, dict(n_tiles=3, rows=4, stage_steps=2, decode="convert")),
    ("uint8", "float32", "gptq", 128, 3, dict(n_tiles=2, rows=2, stage_steps=1, decode="convert", direct=True)),
    ("bfloat16", "bfloat16", None, -1, 1, dict(n_tiles=4, rows=1, stage_steps=2, decode="raw", direct=True)),
    ("bfloat16", "float16", None, 64, 20, dict(n_tiles=2, rows=4, stage_steps=2, small_m=False, m_chunk=32,
                                               decode="raw"))])
@pytest.mark.requires_avx512_bf16
def test_dot_template_register_blocks(name, activation, zero_mode, group, m, config):
    """The AVX512-BF16 template for register blocks of 1 to 16 rows, M not a multiple of them, N not a
    multiple of the column block, groups inside and across stages, per-chunk planes, every plane count, direct
    blocks whose rows accumulate in 1 to 8 splits, 8-bit codes as nibbles and converted."""
    from bitkern.codegen import build_kernel
    from bitkern.codegen.cpu.dot import DotConfig

    spec, q, x, b = matmul_case(name, 88, 384, m, activation, group=group, zero_mode=zero_mode, bias=True)
    packed = pack(q)
    bucket = (1, 16) if config.get("small_m", True) else (17, 1 << 30)
    kernel = build_kernel(spec, 88, 384, "dot", DotConfig(**config), packed.layout, bucket, host_cpu())
    assert_matches_reference(spec, q, x, b, kernel(x, packed, b))


@pytest.mark.parametrize("name, zero_mode, group, m, config", [
    ("int2", None, 128, 1, dict(n_tiles=2, rows=1, stage_steps=1, direct=True)),
    ("uint2", "gptq", 64, 5, dict(n_tiles=3, rows=2, stage_steps=2, direct=True)),
    ("int2", None, 16, 3, dict(n_tiles=1, rows=4, stage_steps=2)),
    ("uint2", "hqq", -1, 20, dict(n_tiles=2, rows=4, stage_steps=2, small_m=False, m_chunk=32)),
    ("uint2", "awq", 32, 40, dict(n_tiles=2, rows=4, stage_steps=1, small_m=False, m_chunk=32, chunk_prologue=True))])
@pytest.mark.requires_avx512_bf16
def test_two_bit_codes_decode_three_k_pairs_per_shift(name, zero_mode, group, m, config):
    """The affine decode takes 2-bit codes where they lie (bits 0, 2 and 4 of a shifted word) and folds their
    smaller offsets back per group: each kernel computes the reference, with under half the shifts of the
    table decode, which shifts every k pair's codes to bit 0."""
    from bitkern.codegen import build_kernel
    from bitkern.codegen.cpu.dot import DotConfig

    spec, q, x, b = matmul_case(name, 88, 384, m, "bfloat16", group=group, zero_mode=zero_mode, bias=True)
    packed = pack(q)
    bucket = (1, 16) if config.get("small_m", True) else (17, 1 << 30)
    kernels = {decode: build_kernel(spec, 88, 384, "dot", DotConfig(**config, decode=decode), packed.layout, bucket,
                                    host_cpu()) for decode in ("affine", "lut")}
    assert_matches_reference(spec, q, x, b, kernels["affine"](x, packed, b))
    # the shifts that move codes (by under 16 bits; the activation prologue's bf16 rounding shifts by 16, its
    # non-finite test by 31)
    shifts = {decode: sum(int(bits, 16) < 16 for bits in re.findall(r"vpsrld\s+\$0x([0-9a-f]+),",
                                                                    disassembly(kernel.library)))
              for decode, kernel in kernels.items()}
    assert 0 < shifts["affine"] < shifts["lut"] / 2


def test_dot_configurations_are_validated():
    from bitkern.codegen.cpu.dot import DotConfig

    with pytest.raises(ValueError, match=r"rows=8 x n_tiles=4 needs more than 27 vector registers"):
        DotConfig(n_tiles=4, rows=8)
    with pytest.raises(ValueError, match=r"small_m kernels take a divisor of 16 rows"):
        DotConfig(rows=3)
    with pytest.raises(ValueError, match=r"m_chunk=36 must be a multiple of rows=8"):
        DotConfig(rows=8, small_m=False, m_chunk=36)
    with pytest.raises(ValueError, match=r"decode='lop3' is not known"):
        DotConfig(decode="lop3")
    with pytest.raises(ValueError, match=r"direct kernels serve few rows: they need small_m"):
        DotConfig(small_m=False, direct=True)
    with pytest.raises(ValueError, match=r"prefetch=-16 is not accepted: weight words ahead, an int >= 0"):
        DotConfig(prefetch=-16)


@pytest.mark.parametrize("template, config", [
    pytest.param("dot", dict(n_tiles=2, rows=1, stage_steps=1, direct=True), marks=pytest.mark.requires_avx512_bf16),
    pytest.param("dot", dict(n_tiles=2, rows=4, stage_steps=2), marks=pytest.mark.requires_avx512_bf16),
    ("lut", dict(n_tiles=4))])
def test_kernels_without_software_prefetch(template, config):
    """prefetch=0 leaves the weight stream to the hardware prefetchers (the tuner times it against software
    prefetch): the kernel computes the reference, and its code has fewer prefetches (the scales' remain)."""
    from bitkern.codegen import build_kernel
    from bitkern.codegen import template as template_named

    spec, q, x, b = matmul_case("int4", 88, 384, 3, "bfloat16", group=64, bias=True)
    packed = pack(q)
    configs = {prefetch: template_named(template).config_type(**config, prefetch=prefetch) for prefetch in (0, 16)}
    kernels = {prefetch: build_kernel(spec, 88, 384, template, configs[prefetch], packed.layout, (1, 4), host_cpu())
               for prefetch in configs}
    assert_matches_reference(spec, q, x, b, kernels[0](x, packed, b))
    prefetches = {prefetch: disassembly(kernel.library).count("prefetcht0")
                  for prefetch, kernel in kernels.items()}
    assert 0 < prefetches[0] < prefetches[16]


AMX_CASES = [("int8", "float32", dict(n_tiles=4, decode="convert")),
             ("uint8", "bfloat16", dict(n_tiles=2, m_tiles=2, small_m=False, m_chunk=64, decode="convert")),
             ("int8", "bfloat16", dict(n_tiles=2, decode="affine")),
             ("uint2", "bfloat16", dict(n_tiles=2, small_m=False, m_chunk=64, decode="affine")),
             ("nf4", "float16", dict(n_tiles=3, small_m=False, m_chunk=32, decode="lut", chunk_prologue=True))]


def _amx_kernel(name, activation, config, device):
    """(spec, weight, x, bias, the AMX kernel of `config` built for `device`)."""
    from bitkern.codegen import build_kernel
    from bitkern.codegen.cpu.amx import AmxConfig

    spec, q, x, b = matmul_case(name, 64, 256, 3 if config.get("small_m", True) else 40, activation, group=64,
                                bias=True)
    bucket = (1, 16) if config.get("small_m", True) else (17, 128)
    return spec, q, x, b, build_kernel(spec, 64, 256, "amx", AmxConfig(**config), "tile16", bucket, device)


@pytest.mark.parametrize("name, activation, config", AMX_CASES)
def test_amx_kernels_build_for_sapphire_rapids_on_any_host(name, activation, config):
    """The AMX template builds where AMX is absent (the tile permission is asked on a kernel's first call):
    its code for a Sapphire Rapids target holds the tile products, and for converted 8-bit codes the
    int-to-float conversions."""
    cpu = host_cpu()
    spr = cpu.at_level("amx")
    *_, kernel = _amx_kernel(name, activation, config, spr)
    assembly = disassembly(kernel.library)
    assert "tdpbf16ps" in assembly and "tileloadd" in assembly
    if config["decode"] == "convert":
        assert "vcvtdq2ps" in assembly


@pytest.mark.requires_amx
@pytest.mark.parametrize("name, activation, config", AMX_CASES)
def test_amx_kernels_compute_the_reference(name, activation, config):
    spec, q, x, b, kernel = _amx_kernel(name, activation, config, host_cpu())
    assert_matches_reference(spec, q, x, b, kernel(x, pack(q), b))


@pytest.mark.parametrize("name, activation, decode, accepted", [
    ("int4", "bfloat16", "convert", "['affine', 'lut']"), ("int8", "float32", "affine", "['convert']")])
def test_matrix_templates_reject_decodes_that_do_not_apply(name, activation, decode, accepted):
    """The convert decode is for 8-bit codes; the affine decode of 8-bit codes for bf16 activations only."""
    from bitkern.codegen.cpu import amx, dot

    spec, *_ = matmul_case(name, 32, 128, 1, activation)
    for template, config in ((amx.TEMPLATE, amx.AmxConfig(decode=decode)), (dot.TEMPLATE, dot.DotConfig(decode=decode))):
        with pytest.raises(ValueError, match=rf"decode='{decode}' does not apply to {name}; accepted: "
                                             rf"{re.escape(accepted)}"):
            template.program(spec, 32, 128, config, "tile16", (1, 16), host_cpu())


@pytest.mark.parametrize("name, k, group, zero_mode, activation", [
    ("uint2", 16, -1, "gptq", "float16"), ("uint1", 16, -1, "awq", "bfloat16"), ("uint4", 48, 8, "hqq", "float32"),
    ("uint4", 40, 8, "gptq", "bfloat16"), ("int2", 16, -1, None, "float32")])
def test_lookup_template_sums_x_over_each_group_only(name, k, group, zero_mode, activation):
    """The zero-point term needs Σx per group: over K below its padded length, and over groups shorter
    than a vector (found by the fuzz: a per-channel K=16 read x past its end)."""
    from bitkern.codegen import build_kernel
    from bitkern.codegen.cpu.lut import LutConfig

    spec, q, x, b = matmul_case(name, 40, k, 3, activation, group=group, zero_mode=zero_mode, bias=True)
    packed = pack(q)
    kernel = build_kernel(spec, 40, k, "lut", LutConfig(n_tiles=2, prefetch=16), packed.layout, (1, 4), host_cpu())
    assert_matches_reference(spec, q, x, b, kernel(x, packed, b))


@pytest.mark.parametrize("name, group, zero_mode", [("int1", 128, None), ("int2", 64, None), ("nf4", -1, None),
                                                     ("uint2", 32, "awq")])
def test_lookup_template_serves_every_row_count(name, group, zero_mode):
    """The lookup kernel emits one body per row count of its range (within M = 1..4); each must compute the
    reference, with a last task that repeats a tile (6 tiles in tasks of 4) and scale prefetches that run past
    the last group."""
    from bitkern.codegen import build_kernel
    from bitkern.codegen.cpu.lut import LutConfig

    spec, q, _, b = matmul_case(name, 88, 384, 1, group=group, zero_mode=zero_mode, bias=True)
    packed = pack(q)
    for rows in ((1, 4), (1, 1), (2, 4)):  # the bodies of a bucket's row counts only
        kernel = build_kernel(spec, 88, 384, "lut", LutConfig(n_tiles=4, prefetch=16), packed.layout, rows, host_cpu())
        for m in range(rows[0], rows[1] + 1):
            x = torch.randn(m, 384, generator=torch.Generator().manual_seed(m)).bfloat16()
            assert_matches_reference(spec, q, x, b, kernel(x, packed, b))


@pytest.mark.parametrize("rows, message", [((1, 5), r"serves at most 4 rows"),
                                           ((3, 2), r"is not a range of row counts")])
def test_lookup_template_rejects_row_ranges_it_cannot_serve(rows, message):
    from bitkern.codegen.cpu.emit import lut
    from bitkern.codegen.cpu.lut import LutConfig

    spec, *_ = matmul_case("int2", 32, 128, 1)
    with pytest.raises(ValueError, match=re.escape(f"rows={rows}") + ".*" + message):
        lut.build(spec, 32, 128, LutConfig(), 2, rows, host_cpu().level)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [16, 48, 80, 200])
def test_lookup_kernels_split_into_any_number_of_chunks(threads, n):
    """Each parallel chunk tabulates x itself and runs its own consecutive tasks: for any thread count the
    build assumes (more chunks than the runtime has threads, fewer tasks than threads, a short last chunk)
    every tile is computed once, by the same arithmetic, so outputs are bit-identical across thread counts."""

    from bitkern.codegen import build_kernel
    from bitkern.codegen.cpu.lut import LutConfig

    spec, q, _, b = matmul_case("int2", n, 256, 1, group=64, bias=True)
    packed = pack(q)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(n)).bfloat16()
    device = dataclasses.replace(host_cpu(), cores=threads)
    y = build_kernel(spec, n, 256, "lut", LutConfig(n_tiles=2, prefetch=16), packed.layout, (1, 4), device)(x, packed, b)
    assert_matches_reference(spec, q, x, b, y)
    single = dataclasses.replace(host_cpu(), cores=1)
    one_chunk = build_kernel(spec, n, 256, "lut", LutConfig(n_tiles=2, prefetch=16), packed.layout, (1, 4), single)
    assert torch.equal(y, one_chunk(x, packed, b))


def test_kernels_are_built_once_per_bucket():
    spec, q, x, _ = matmul_case("uint4", 64, 256, 1)
    packed = pack(q)
    first = kernel_for(spec, 64, 256, 1, packed.layout)
    assert kernel_for(spec, 64, 256, 1, packed.layout) is first
    few = kernel_for(spec, 64, 256, 4, packed.layout)
    assert few is not first and kernel_for(spec, 64, 256, 2, packed.layout) is few
    middle = kernel_for(spec, 64, 256, 16, packed.layout)
    assert middle is not few and kernel_for(spec, 64, 256, 5, packed.layout) is middle
    large = kernel_for(spec, 64, 256, 4096, packed.layout)
    assert kernel_for(spec, 64, 256, 129, packed.layout) is large
    assert (first.m_range, few.m_range, middle.m_range, large.m_range[0]) == ((1, 1), (2, 4), (5, 16), 129)
    assert first.record.bucket == (1, 1) and first.record.chosen is not None
    for kernel, rows in ((first, 2), (few, 1), (few, 5), (middle, 17)):  # a kernel serves its bucket's rows only
        with pytest.raises(ValueError, match=f"x has {rows} rows; this .* kernel serves {kernel.m_range[0]} to"):
            kernel(torch.zeros(rows, 256, dtype=x.dtype), packed)


@pytest.mark.parametrize("name", ["int4", "uint2", "int1", "nf4", "uint3", "int8", "mxfp4", "bfloat16"])
@pytest.mark.parametrize("n, k", [(16, 128), (37, 100), (5, 8), (3, 33)])
def test_layout_transform_round_trips(name, n, k):
    block = ttype.get(name).block_size > 1
    if block and k % 32:
        pytest.skip("block types need K divisible by their block")
    q = bitkern.quantize(torch.randn(n, k), name, group_size=None if block else -1)
    packed = pack(q)
    assert packed.layout == "tile16"
    back = packed.to_portable()
    for field in ("qweight", "scales", "zeros", "tensor_scale"):
        a, b = getattr(back, field), getattr(q, field)
        assert (a is None and b is None) or torch.equal(a, b), field
    assert to_layout(q, "rowmajor").to_portable().qweight is q.qweight


def test_call_errors_name_the_argument():
    spec, q, x, _ = matmul_case("int4", 32, 128, 2)
    packed = pack(q)
    with pytest.raises(TypeError, match=r"weight must be packed for the kernels with bitkern.pack"):
        spec(x, q)
    with pytest.raises(TypeError, match="x has dtype torch.float32; this Matmul takes activation_dtype=bfloat16"):
        spec(x.float(), packed)
    with pytest.raises(ValueError, match=r"its last dimension must be in_features=128"):
        spec(torch.randn(2, 64).bfloat16(), packed)
    with pytest.raises(ValueError, match="weight has group_size=128 but the Matmul spec has group_size=64"):
        Matmul("int4", "bfloat16", group_size=64)(x, packed)
    assert isinstance(packed, PackedWeight)
    with pytest.raises(TypeError, match="QuantizedWeight"):
        pack(torch.zeros(4, 4))


def _misaligned(tensor):
    """A copy of `tensor` that starts 8 bytes past a 64-byte boundary."""
    raw = torch.empty(tensor.numel() * tensor.element_size() + 72, dtype=torch.uint8)
    start = (64 - raw.data_ptr() % 64) % 64 + 8
    view = raw[start:start + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
    view.copy_(tensor)
    return view


@pytest.mark.parametrize("name, activation", [("int4", "bfloat16"), ("nf4", "float32"), ("int8", "float32"),
                                              ("int1", "bfloat16")])
def test_unaligned_tensors_are_accepted(name, activation):
    spec, q, x, b = matmul_case(name, 64, 256, 3, activation, bias=True)
    packed = pack(q)
    unaligned = PackedWeight(packed.layout, packed.ttype, packed.shape, packed.group_size, packed.zero_mode,
                             _misaligned(packed.qweight), _misaligned(packed.scales))
    assert unaligned.qweight.data_ptr() % 64 == 8
    y = spec(_misaligned(x), unaligned, _misaligned(b))
    assert_matches_reference(spec, q, x, b, y)


def test_kernel_arguments_are_made_once_and_follow_replaced_tensors():
    spec, q, x, _ = matmul_case("int4", 64, 256, 2, "bfloat16", output="bfloat16")
    packed = pack(q)
    weight = PackedWeight(packed.layout, packed.ttype, packed.shape, packed.group_size, packed.zero_mode,
                          _misaligned(packed.qweight), packed.scales)
    first = weight.kernel_arguments()
    assert first[0] is not weight.qweight and first[0].data_ptr() % 64 == 0 and torch.equal(first[0], packed.qweight)
    assert first[1] is weight.scales and weight.kernel_arguments() is first  # aligned tensors pass as they are
    y = spec(x, weight)
    weight.scales = weight.scales * 2  # a replaced tensor is picked up, not the one the arguments were made from
    assert weight.kernel_arguments()[1] is weight.scales
    assert torch.equal(spec(x, weight), y * 2)


@pytest.mark.parametrize("m", [1, 2, 17])
def test_bfloat16_weights_give_torch_s_bf16_linear_up_to_summation_order(m):
    """A bf16 weight stored as bitkern's bfloat16 (a cast: scale 1) is multiplied exactly as torch's bf16 linear
    does (bf16 products summed in float32, rounded to bf16 once): the results differ by the summation order only,
    at most one bf16 rounding step of the output."""
    generator = torch.Generator().manual_seed(m)
    weight = torch.randn(300, 2048, generator=generator).bfloat16()
    x = torch.randn(m, 2048, generator=generator).bfloat16()
    q = bitkern.quantize(weight, "bfloat16", group_size=-1)
    assert torch.equal(q.dequantize(torch.bfloat16), weight) and bool((q.scales == 1).all())
    spec = Matmul.for_weight(q, "bfloat16", output_dtype="bfloat16")
    y, expected = spec(x, pack(q)), torch.nn.functional.linear(x, weight)
    exact = x.double() @ weight.double().T
    assert float((y.double() - exact).abs().max()) <= float((expected.double() - exact).abs().max()) * 2 + 1e-6
    assert float((y.float() - expected.float()).abs().max()) <= 2**-7 * float(exact.abs().max())
