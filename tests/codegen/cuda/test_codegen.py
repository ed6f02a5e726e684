"""CUDA code generation without a GPU: every weight-type family's GEMM and GEMV kernels lower with TVM and
compile with nvcc to cubins for sm_80 and sm_90, and their PTX holds the instructions the templates are
built around (mma.sync, ldmatrix, cp.async; lop3 for integer weights; warp shuffles and 128-bit loads in
the GEMV).  All kernels of an architecture go into one .cu, compiled once per test session."""

import dataclasses
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from bitkern.codegen import build_kernel, template as template_named
from bitkern.codegen.cuda import GemmConfig, GemvConfig, MmaGemvConfig
from bitkern.codegen.cuda.compile import evaluate, lower, nvcc
from bitkern.codegen.cuda.expr import decoder_for
from bitkern.ops import Matmul
from bitkern.tuner import cuda_device

pytestmark = pytest.mark.requires_nvcc

INTEGER = ("int4", "uint4", "int2", "uint2", "int1", "uint1", "int8", "uint8")


def _float(weight, activation="float16", group=128, zero_mode="none", **options):
    scale = "bfloat16" if activation == "bfloat16" and "fp" not in weight and weight != "nvfp4" else "float16"
    return Matmul(weight, activation, group_size=group, zero_mode=zero_mode, scale_dtype=scale, **options)


GEMM_CASES = {  # name: (spec, N, K, config)
    "int4_f16": (_float("int4"), 256, 512, GemmConfig()),
    "uint4_gptq_f16": (_float("uint4", zero_mode="gptq", bias=True), 256, 512, GemmConfig()),
    "uint4_awq_bf16": (_float("uint4", "bfloat16", zero_mode="awq"), 256, 512, GemmConfig(block_k=64)),
    "uint4_hqq_f16": (_float("uint4", zero_mode="hqq", output_dtype="float32"), 256, 512, GemmConfig(stages=2)),
    "int2_bf16": (_float("int2", "bfloat16"), 256, 512, GemmConfig(block_k=64)),
    "uint2_gptq_f16": (_float("uint2", zero_mode="gptq", group=64), 256, 512, GemmConfig(block_k=64)),
    "int1_f16": (_float("int1", group=-1), 128, 384, GemmConfig(block_m=32, warp_m=16, block_n=64, warp_n=32,
                                                               block_k=64)),
    "int8_f16": (_float("int8"), 128, 512, GemmConfig(block_k=128, stages=2)),
    "int1_group16_tir_f16": (_float("int1", group=16), 128, 256, GemmConfig(block_n=64, warp_n=32, block_k=64,
                                                                            decode="tir")),
    "nf4_f16": (_float("nf4", group=64), 96, 200, GemmConfig(block_m=32, block_n=32, warp_n=32)),
    "fp4_bf16": (_float("fp4_e2m1", "bfloat16"), 256, 512, GemmConfig()),
    "e4m3_f16": (_float("float8_e4m3"), 128, 256, GemmConfig(block_k=128, block_n=64, warp_n=32)),
    "e5m2_bf16": (_float("float8_e5m2", "bfloat16"), 128, 256, GemmConfig(block_k=128, block_n=64, warp_n=32)),
    "mxfp4_bf16": (Matmul("mxfp4", "bfloat16", group_size=32, bias=True), 144, 96,
                   GemmConfig(block_m=16, warp_m=16, block_n=48, warp_n=16)),
    "nvfp4_f16": (Matmul("nvfp4", "float16", group_size=16), 256, 512, GemmConfig(stages=4)),
    "int4_int8": (Matmul("int4", "int8", accumulate_dtype="int32", group_size=-1, output_dtype="float16"), 256, 512,
                  GemmConfig(block_k=64)),
    "uint4_gptq_int8": (Matmul("uint4", "int8", accumulate_dtype="int32", group_size=-1, zero_mode="gptq"), 256,
                        512, GemmConfig(block_k=64)),
    "splitk_int4_f16": (_float("int4", bias=True), 256, 1024, GemmConfig(block_m=16, warp_m=16, block_n=64, warp_n=32,
                                                                         block_k=64, stages=2, split_k=4)),
}
EPILOGUE_GEMM_CASES = {  # the fusion epilogues in the output stage
    "splitk_uint4_gelu_res_bf16": (_float("uint4", "bfloat16", zero_mode="gptq", bias=True, epilogue="gelu",
                                          residual=True), 128, 512, GemmConfig(block_k=64, split_k=2)),
    "int4_swiglu_f16": (_float("int4", bias=True, epilogue="swiglu"), 256, 512, GemmConfig()),
    "uint4_gptq_swiglu_res_bf16": (_float("uint4", "bfloat16", zero_mode="gptq", epilogue="swiglu", residual=True),
                                   128, 256, GemmConfig(block_m=32, warp_m=16, block_n=64, warp_n=32, block_k=64)),
    "int4_gelu_res_f16": (_float("int4", epilogue="gelu", residual=True), 256, 512, GemmConfig(block_k=64)),
    "nf4_silu_bf16": (_float("nf4", "bfloat16", bias=True, epilogue="silu"), 128, 256,
                      GemmConfig(block_m=16, warp_m=16, block_n=32, warp_n=16, block_k=64, stages=2)),
    "int8_relu_res_int8": (Matmul("int8", "int8", accumulate_dtype="int32", group_size=-1, output_dtype="float16",
                                  epilogue="relu", residual=True), 128, 512, GemmConfig(block_k=64)),
}
GEMM_CASES.update(EPILOGUE_GEMM_CASES)
FP8_GEMM_CASES = {  # float8_e4m3 mma: sm_89 and newer
    "fp4_e4m3": (Matmul("fp4_e2m1", "float8_e4m3", group_size=-1, output_dtype="bfloat16"), 256, 640,
                 GemmConfig(block_k=64, stages=4)),
    "int4_e4m3": (Matmul("int4", "float8_e4m3", group_size=-1, output_dtype="float16", bias=True), 256, 512,
                  GemmConfig(block_k=128)),
}
GEMV_CASES = {
    "gemv_uint4_gptq_f16": (_float("uint4", zero_mode="gptq"), 4096, 4096, GemvConfig()),
    "gemv_int4_bf16_rows4": (_float("int4", "bfloat16", bias=True), 256, 512,
                             GemvConfig(rows=4, k_threads=16, words=2)),
    "gemv_nf4_f16": (_float("nf4", group=64), 96, 256, GemvConfig(k_threads=8)),
    "gemv_int4_int8": (Matmul("int4", "int8", accumulate_dtype="int32", group_size=-1, output_dtype="float16"), 256,
                       512, GemvConfig(k_threads=16)),
    "gemv_uint2_awq_f32": (Matmul("uint2", "float32", group_size=64, zero_mode="awq", scale_dtype="float32"), 64, 1024,
                           GemvConfig(rows=2, k_threads=16)),
    "gemv_mxfp4_bf16": (Matmul("mxfp4", "bfloat16", group_size=32), 128, 1024, GemvConfig(k_threads=8)),
    "gemv_splitk_uint4_f16": (_float("uint4", zero_mode="gptq", bias=True), 4096, 4096,
                              GemvConfig(split_k=4, k_threads=8, rows=2)),
    "gemv_int2_group8_tir_f16": (_float("int2", group=8), 128, 512, GemvConfig(k_threads=8, words=1, decode="tir")),
}
EPILOGUE_GEMV_CASES = {
    "gemv_int4_silu_res_f16": (_float("int4", bias=True, epilogue="silu", residual=True), 256, 512,
                               GemvConfig(k_threads=16)),
    "gemv_int4_relu_rows4_bf16": (_float("int4", "bfloat16", epilogue="relu"), 256, 512,
                                  GemvConfig(rows=4, k_threads=16, words=2)),
    "gemv_splitk_gelu_res_f16": (_float("uint4", zero_mode="gptq", bias=True, epilogue="gelu", residual=True), 512,
                                 4096, GemvConfig(split_k=4, k_threads=8, rows=2)),
}
GEMV_CASES.update(EPILOGUE_GEMV_CASES)
MMA_GEMV_CASES = {
    "mma_gemv_int4_f16": (_float("int4"), 4096, 4096, MmaGemvConfig()),
    "mma_gemv_uint4_gptq_bf16_rows16": (_float("uint4", "bfloat16", zero_mode="gptq", bias=True), 256, 512,
                                        MmaGemvConfig(block_m=16, n_tiles=2, words=2)),
    "mma_gemv_nf4_rows32_f16": (_float("nf4", group=64), 96, 256, MmaGemvConfig(block_m=32, warps=2)),
    "mma_gemv_int8_f16": (_float("int8"), 128, 512, MmaGemvConfig(words=2)),
    "mma_gemv_int1_bf16": (_float("int1", "bfloat16", group=-1), 128, 384, MmaGemvConfig(warps=2, words=1)),
    "mma_gemv_splitk_gelu_res_f16": (_float("uint4", zero_mode="hqq", bias=True, epilogue="gelu", residual=True), 512,
                                     4096, MmaGemvConfig(split_k=8)),
    "mma_gemv_ragged_k_f16": (_float("int4", group=-1), 17, 40, MmaGemvConfig(warps=2, words=1)),
    "mma_gemv_silu_res_bf16": (_float("int4", "bfloat16", bias=True, epilogue="silu", residual=True), 256, 512,
                               MmaGemvConfig(block_m=16, n_tiles=2)),
    "mma_gemv_relu_f32": (_float("nf4", epilogue="relu", output_dtype="float32"), 96, 256, MmaGemvConfig()),
}
ARCHS = ("sm_80", "sm_90")


def _cases(arch):
    cases = {name: ("gemm", *case) for name, case in GEMM_CASES.items()}
    if arch == "sm_90":
        cases.update({name: ("gemm", *case) for name, case in FP8_GEMM_CASES.items()})
    cases.update({name: ("gemv", *case) for name, case in GEMV_CASES.items()})
    cases.update({name: ("mma_gemv", *case) for name, case in MMA_GEMV_CASES.items()})
    return cases


@pytest.fixture(scope="module", params=ARCHS)
def compiled(request):
    """(arch, cases, launches per case, binary, PTX per kernel) for one architecture: one nvcc call."""
    arch = request.param
    cases = _cases(arch)
    funcs, owners = {}, {}
    for name, (template, spec, n, k, config) in cases.items():
        for symbol, func in template_named(template).functions(spec, n, k, config, arch, prefix=f"{name}_").items():
            funcs[symbol] = func
            owners[symbol] = name
    source, launches = lower(funcs, arch)
    binary = nvcc(source, arch)
    by_case = {}
    for symbol, found in launches.items():
        by_case.setdefault(owners[symbol], []).extend(found)
    return arch, cases, by_case, binary, _entries(binary.ptx)


def _entries(ptx: str) -> dict:
    """PTX text of each .entry (the device functions are inlined into them)."""
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.entry\s+(\w+)\s*\(", ptx)]
    return {name: ptx[start:(starts[i + 1][0] if i + 1 < len(starts) else len(ptx))]
            for i, (start, name) in enumerate(starts)}


def test_every_kernel_compiles_to_the_cubin(compiled):
    arch, cases, launches, binary, entries = compiled
    assert binary.cubin[:4] == b"\x7fELF" and binary.arch == arch
    for name in cases:
        for launch in launches[name]:
            assert launch.name in entries, f"{launch.name} missing from the PTX"
            assert 0 < binary.registers[launch.name] <= 255


@pytest.mark.parametrize("name", list(GEMM_CASES) + list(FP8_GEMM_CASES))
def test_gemm_ptx_has_mma_ldmatrix_cp_async_and_lop3(compiled, name):
    arch, cases, launches, binary, entries = compiled
    if name not in cases:
        pytest.skip(f"float8_e4m3 mma needs sm_89+, not {arch}")
    _, spec, _, _, config = cases[name]
    launch = launches[name][0]
    ptx = entries[launch.name]
    if config.split_k > 1:  # blockIdx.z takes the K slice; the reduce kernel follows
        assert [launch.name for launch in launches[name]] == [f"{name}_gemm_kernel", f"{name}_gemm_reduce_kernel"]
        assert "%ctaid.z" in ptx and "acc" in launch.params and "partial" in launches[name][1].params
    else:
        assert len(launches[name]) == 1
    shape = "m16n8k32" if spec.activation_dtype in ("int8", "float8_e4m3") else "m16n8k16"
    kinds = {"float16": "f16.f16", "bfloat16": "bf16.bf16", "int8": "s8.s8", "float8_e4m3": "e4m3.e4m3"}
    assert re.search(rf"mma\.sync\.aligned\.{shape}\.row\.col\.\w+\.{kinds[spec.activation_dtype]}", ptx)
    assert "ldmatrix.sync.aligned" in ptx
    assert "cp.async.cg.shared.global" in ptx and "cp.async.wait_group" in ptx
    decoder = decoder_for(spec)
    if spec.weight_dtype in INTEGER and spec.activation_dtype in ("float16", "bfloat16"):
        assert decoder.uses_lop3  # every integer weight decodes to 16-bit floats with LOP3
    assert ("lop3.b32" in ptx) == (decoder.uses_lop3 and cases[name][4].decode == "lop3")


@pytest.mark.parametrize("name", list(GEMV_CASES))
def test_gemv_ptx_has_lop3_shuffles_and_wide_loads(compiled, name):
    _, cases, launches, binary, entries = compiled
    _, spec, _, _, config = cases[name]
    ptx = entries[launches[name][0].name]
    assert "shfl.sync" in ptx
    width = {4: "v4", 2: "v2"}.get(config.words)
    if width:
        assert re.search(rf"ld\.global\.nc\.{width}\.(u32|b32|s32)", ptx), "no vectorized weight load"
    assert ("lop3.b32" in ptx) == (decoder_for(spec).uses_lop3 and config.decode == "lop3")
    if config.split_k > 1:
        assert [launch.name for launch in launches[name]] == [f"{name}_gemv_kernel", f"{name}_gemv_reduce_kernel"]


@pytest.mark.parametrize("name", list(MMA_GEMV_CASES))
def test_mma_gemv_feeds_decoded_registers_to_mma(compiled, name):
    """The TensorCore GEMV: mma.sync on registers the decode filled (no ldmatrix, no shared memory), 128- or 64-bit
    weight loads, lop3 for integer weights; one launch that writes y, or with split-K partial sums for the reduce
    kernel, which then holds the output stage."""
    _, cases, launches, _, entries = compiled
    _, spec, _, _, config = cases[name]
    ptx = entries[launches[name][0].name]
    kind = {"float16": "f16", "bfloat16": "bf16"}[spec.activation_dtype]
    assert re.search(rf"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.{kind}\.{kind}\.f32", ptx)
    assert "ldmatrix" not in ptx and ".shared" not in ptx
    width = {4: "v4", 2: "v2"}.get(config.words)
    if width:
        assert re.search(rf"ld\.global\.nc\.{width}\.(u32|b32|s32)", ptx), "no vectorized weight load"
    assert ("lop3.b32" in ptx) == decoder_for(spec).uses_lop3
    if config.split_k == 1:
        assert [launch.name for launch in launches[name]] == [f"{name}_mma_gemv_kernel"]
        return
    assert [launch.name for launch in launches[name]] == [f"{name}_mma_gemv_kernel", f"{name}_mma_gemv_reduce_kernel"]
    assert "mma.sync" not in entries[launches[name][1].name]


@pytest.mark.parametrize("name", ["nf4_f16", "nf4_silu_bf16", "gemv_nf4_f16"])
def test_value_tables_are_read_through_the_read_only_cache_not_constant_memory(compiled, name):
    """Codebook types (nf4) look their values up per code.  From constant memory a warp's different codes
    serialize (the H100's nf4 GEMVs ran at 0.05 of its bandwidth, int4 at up to 0.47); the table lives in
    global memory and is read with ld.global.nc, through the read-only data cache."""
    _, cases, launches, binary, entries = compiled
    ptx = entries[launches[name][0].name]
    table = decoder_for(cases[name][1]).table
    assert re.search(rf"\.global \.align \d+ \.b8 {table}\[64\]", binary.ptx), "the table is not in global memory"
    assert "ld.const" not in ptx
    assert len(re.findall(r"ld\.global\.nc\.f32", ptx)) >= 8


def _float32_constant(value: float) -> str:
    """A float32 constant as PTX writes it (0f and its bits in hex)."""
    return "0f" + struct.pack(">f", value).hex().upper()


@pytest.mark.parametrize("name", list(GEMM_CASES) + list(GEMV_CASES) + list(MMA_GEMV_CASES))
def test_output_stage_holds_the_epilogue(compiled, name):
    """The PTX of the launch that writes y holds the spec's epilogue: exp for SiLU, GELU and SwiGLU (and none
    elsewhere), ReLU's float max, GELU's erf polynomial; a residual is one more kernel parameter, read there."""
    _, cases, launches, _, entries = compiled
    _, spec, _, _, _ = cases[name]
    last = launches[name][-1]
    ptx = entries[last.name]
    assert ("ex2.approx" in ptx) == (spec.epilogue in ("silu", "gelu", "swiglu")), name
    if spec.epilogue == "relu":
        assert re.search(r"max(\.ftz)?\.f32", ptx)
    assert (_float32_constant(1.061405429) in ptx) == (spec.epilogue == "gelu")
    assert ("residual" in last.params) == spec.residual
    assert [launch.name for launch in launches[name]][:1] == [f"{name}_{cases[name][0]}_kernel"]


def test_templates_serve_the_epilogues_and_the_gemvs_leave_swiglu_to_the_gemm():
    from bitkern.tuner.space import enumerate_candidates, usable_templates

    sm_90 = cuda_device("sm_90")
    for epilogue in ("relu", "silu", "gelu", "swiglu"):
        spec = _float("int4", epilogue=epilogue, residual=True)
        usable, unused = usable_templates(spec, 256, 512, (1, 1), "lop3", sm_90)
        assert {t.name for t in usable} == ({"gemm"} if epilogue == "swiglu" else {"gemm", "gemv", "mma_gemv"}), \
            unused
    assert "epilogue='swiglu'" in unused["gemv"] and "epilogue='swiglu'" in unused["mma_gemv"]
    _, candidates = enumerate_candidates(spec, 256, 512, (1, 16), "lop3", sm_90)
    assert candidates and all(c.template == "gemm" and c.config.warp_n % 32 == 0 for c in candidates)
    with pytest.raises(ValueError, match="warp_n=16 with epilogue='swiglu'"):
        build_kernel(spec, 256, 512, "gemm", GemmConfig(block_n=32, warp_n=16), "lop3", (1, 16), sm_90)


def test_fused_calls_are_rehearsed_up_to_the_driver(tmp_path):
    """A fused call through the dispatch as on an sm_90 GPU (host tensors, nothing launched): the tuner's kernel
    is found, y has the epilogue's columns, the residual is packed as the kernel's argument and every launch
    matches the cubin; the GEMV (M = 1) for GELU, the GEMM for SwiGLU."""
    import torch

    import bitkern
    from bitkern.cache import DiskStore
    from bitkern.cache.dispatch import rehearsal

    q = bitkern.quantize(torch.randn(128, 256), "int4")
    x = torch.randn(1, 256).half()
    for epilogue, template in (("gelu", "gemv"), ("swiglu", "gemm")):
        spec = Matmul.for_weight(q, "float16", epilogue=epilogue, residual=True)
        residual = torch.randn(1, spec.out_features(128)).half()
        with rehearsal(cuda_device("sm_90"), DiskStore(tmp_path)) as launches:
            y = spec(x, bitkern.pack(q), None, residual)
        assert y.shape == (1, spec.out_features(128)) and y.dtype == torch.float16
        (launch,) = launches
        assert launch.name.startswith(template)
        assert ("pointer", residual.data_ptr()) in launch.arguments


def test_resources_match_the_compiled_kernels(compiled):
    """Shared memory: the estimate bounds the kernel's, and exceeds it by at most the epilogue tile (which
    TVM may fit into freed pipeline memory); the register estimate is within 2x of ptxas' count."""
    arch, cases, launches, binary, _ = compiled
    for name, (template, spec, n, k, config) in cases.items():
        launch = launches[name][0]
        estimate = template_named(template).resources(spec, k, config)
        epilogue = config.block_m * config.block_n * 4 if template == "gemm" else 0
        shared = launch.shared_bytes + launch.static_shared_bytes
        assert estimate.shared_bytes - epilogue <= shared <= estimate.shared_bytes, name
        assert estimate.threads == evaluate(launch.block[0], 1) * evaluate(launch.block[1], 1) * \
            evaluate(launch.block[2], 1), name
        actual = binary.registers[launch.name]
        assert actual / 2 <= estimate.registers <= 2 * actual, (name, estimate.registers, actual)


def test_launch_extents_follow_m(compiled):
    _, cases, launches, _, _ = compiled
    template, spec, n, k, config = cases["uint4_gptq_f16"]
    (launch,) = launches["uint4_gptq_f16"]
    assert [evaluate(g, 1) for g in launch.grid] == [n // config.block_n, 1, 1]
    assert [evaluate(g, 65) for g in launch.grid] == [n // config.block_n, 2, 1]
    assert launch.params[-1] == "M" and {"x", "qweight", "scales", "zeros", "bias", "y"} <= set(launch.params)


def test_launch_extents_cost_no_more_than_their_own_operations(compiled):
    """A call evaluates its launch extents every time; the first GPU run found each call spending ~70 ms there
    (every operator was computed for every node, so min(M, 2**30) was also shifted left by 2**30 bits)."""
    import tracemalloc

    _, _, launches, _, _ = compiled
    expressions = [g for calls in launches.values() for launch in calls for g in (*launch.grid, *launch.block)]
    expressions += [("<<", ("min", "M", 1 << 30), 2), (">>", ("+", ("min", "M", 1 << 30), 15), 4),
                    ("//", "M", 0), ("%", 7, 0), ("max", ("-", "M", 3), ("*", 2, "M"))]
    tracemalloc.start()
    try:
        values = [evaluate(expression, m) for expression in expressions for m in (1, 65, 4096)]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
    assert values[-15:] == [4, 260, 16384, 1, 5, 256, 0, 0, 0, 0, 0, 0, 2, 130, 8192]


def test_kernel_checks_its_inputs_before_launching():
    import torch

    import bitkern
    from bitkern.codegen import pack as pack_for_cpu
    from bitkern.codegen.cuda import pack

    spec = Matmul("int4", "float16", group_size=-1)
    kernel = build_kernel(spec, 64, 128, "gemv", GemvConfig(k_threads=4, words=1, warps=2), "lop3", (1, 4),
                          cuda_device("sm_80"))
    assert kernel.binary.cubin and "gemv_kernel" in kernel.source
    q = bitkern.quantize(torch.randn(64, 128), "int4", group_size=-1)
    x = torch.randn(2, 128).half()
    with pytest.raises(ValueError, match="this kernel runs on CUDA devices"):
        kernel(x, pack(q))
    with pytest.raises(ValueError, match="x has 0 rows; a CUDA kernel serves 1 to"):
        kernel(x[:0], pack(q))
    with pytest.raises(TypeError, match="weight must be packed in the 'lop3' layout"):
        kernel(x, pack_for_cpu(q))


@pytest.mark.parametrize("template, config, launches", [
    ("mma_gemv", MmaGemvConfig(warps=2, words=2), 1), ("mma_gemv", MmaGemvConfig(warps=2, words=2, split_k=2), 2),
    ("gemm", GemmConfig(block_m=16, warp_m=16, block_n=64, warp_n=32, block_k=64, stages=2, split_k=2), 2)])
def test_planned_calls_hold_every_tensor_they_point_into(template, config, launches):
    """Every pointer a planned launch carries points into a tensor the launch holds, so that tensors `plan` makes
    itself (the partial sums, a float32 copy of a float16 bias) live until the launch is enqueued.  The first GPU
    memcheck of the TensorCore GEMV found its kernel writing freed memory: `plan` dropped the partial sums before the
    launch (torch's caching allocator only returns such a block to its pool, so no other test saw it)."""
    import gc
    import weakref

    import torch

    import bitkern
    from bitkern.codegen.cuda import pack

    spec = Matmul("int4", "float16", group_size=-1, bias=True)
    kernel = build_kernel(spec, 64, 256, template, config, "lop3", (1, 16), cuda_device("sm_90"))
    q = bitkern.quantize(torch.randn(64, 256), "int4", group_size=-1)
    y, calls = kernel.plan(torch.randn(3, 256).half(), pack(q), torch.randn(64).half())
    gc.collect()
    assert len(calls) == launches
    for call in calls:
        held = {tensor.data_ptr() for tensor in call.keep}
        pointers = [value for kind, value in call.arguments if kind == "pointer"]
        assert pointers and set(pointers) <= held, call.name
    # the bias's float32 copy and split-K's partial sums (under both of its names)
    made = list({id(t): t for t in calls[0].keep if t.dtype == torch.float32}.values())
    assert sorted(t.dim() for t in made) == ([1] if launches == 1 else [1, 3])
    released = [weakref.ref(t) for t in made]
    del made, calls, call
    gc.collect()
    assert all(ref() is None for ref in released)  # held by the calls alone: freed with them, after the launches


def test_build_errors_name_the_problem():
    spec = Matmul("int4", "float16", group_size=128)
    sm_80, sm_90 = cuda_device("sm_80"), cuda_device("sm_90")
    with pytest.raises(ValueError, match="template='wmma' is not known"):
        build_kernel(spec, 64, 256, "wmma", GemmConfig(), "lop3", (1, 16), sm_80)
    with pytest.raises(TypeError, match="config must be a GemvConfig"):
        build_kernel(spec, 64, 256, "gemv", GemmConfig(), "lop3", (1, 16), sm_80)
    with pytest.raises(ValueError, match="arch='sm_75' is not supported"):
        build_kernel(spec, 64, 256, "gemm", GemmConfig(), "lop3", (1, 16), dataclasses.replace(sm_80, arch="sm_75"))
    with pytest.raises(ValueError, match="the gemm template reads the lop3 layout, not 'tile16'"):
        build_kernel(spec, 64, 256, "gemm", GemmConfig(), "tile16", (1, 16), sm_80)
    with pytest.raises(ValueError, match="block_n=128 does not divide the padded N=64"):
        build_kernel(spec, 64, 256, "gemm", GemmConfig(), "lop3", (1, 16), sm_80)
    with pytest.raises(ValueError, match=r"the decoded tile \(69632 bytes\) is static shared memory"):
        build_kernel(spec, 256, 512, "gemm", GemmConfig(block_n=256, block_k=128), "lop3", (1, 16), sm_90)
    with pytest.raises(ValueError, match="float8_e4m3 mma on sm_80"):
        build_kernel(Matmul("int4", "float8_e4m3", group_size=-1, output_dtype="float16"), 128, 256, "gemm",
                     GemmConfig(), "lop3", (1, 16), sm_80)
    with pytest.raises(ValueError, match="group_size=128 with int8 activations"):
        build_kernel(Matmul("int4", "int8", accumulate_dtype="int32"), 128, 256, "gemm", GemmConfig(), "lop3",
                     (1, 16), sm_80)
    with pytest.raises(ValueError, match=r"layout 'lop3' holds \[1, 2, 4, 8\]-bit types; 'int3'"):
        build_kernel(Matmul("int3", "float16"), 128, 256, "gemv", GemvConfig(), "lop3", (1, 16), sm_80)
    with pytest.raises(ValueError, match="activation_dtype=float32 \\(mma takes"):
        build_kernel(Matmul("int4", "float32"), 128, 256, "gemm", GemmConfig(), "lop3", (1, 16), sm_80)


@pytest.mark.parametrize("field, value, message", [
    ("warp_m", 24, "warp_m=24 must be a multiple of 16"), ("block_n", 96, "whole number of warp tiles"),
    ("block_k", 48, "block_k=48 is not supported"), ("stages", 0, "stages=0 must be a positive int"),
    ("decode", "lut", "decode='lut' is not known"), ("split_k", 3, "split_k=3 is not supported; accepted: 1, 2, 4, 8")])
def test_gemm_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        GemmConfig(**{field: value})


@pytest.mark.parametrize("field, value, message", [
    ("k_threads", 3, "k_threads=3 must be a power of two"), ("words", 3, "words=3 is not supported"),
    ("warps", 64, "warps=64 exceed 1024 threads"), ("rows", 0, "rows=0 must be a positive int")])
def test_gemv_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        GemvConfig(**{field: value})


@pytest.mark.parametrize("field, value, message", [
    ("block_m", 128, "block_m=128 is not supported; accepted: 8, 16, 32, 64"), ("words", 8, "words=8 is not supported"),
    ("split_k", 3, "split_k=3 is not supported"), ("warps", 33, "warps=33 exceed 1024 threads"),
    ("n_tiles", 0, "n_tiles=0 must be a positive int")])
def test_mma_gemv_config_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        MmaGemvConfig(**{field: value})


def test_mma_gemv_refuses_what_its_fragments_cannot_hold():
    """Named reasons before any build: float32 / int8 activations (no 16-bit mma), a group smaller than a word,
    a thread's k-step below one 128-bit load of x (int8 at one word), K or N not divisible by the block's step."""
    mma_gemv, sm_90 = template_named("mma_gemv"), "sm_90"
    assert "activation_dtype=float32" in mma_gemv.reason(Matmul("int4", "float32"), 64, 256, MmaGemvConfig(), sm_90)
    assert "group_size=8" in mma_gemv.reason(_float("int2", group=8), 64, 256, MmaGemvConfig(), sm_90)
    assert "words=1 x 4 codes" in mma_gemv.reason(_float("int8"), 64, 256, MmaGemvConfig(words=1), sm_90)
    assert "does not divide the padded K=128" in mma_gemv.reason(_float("int4"), 64, 128, MmaGemvConfig(split_k=2),
                                                                   sm_90)
    assert "64 columns per block" in mma_gemv.reason(_float("int4"), 48, 256, MmaGemvConfig(warps=8), sm_90)


def test_saved_kernel_loads_without_tvm(tmp_path):
    """A built kernel round-trips through files, and loading it imports neither TVM nor the compiler path."""
    from bitkern.codegen.cuda import load_kernel

    spec = Matmul("uint4", "bfloat16", group_size=64, zero_mode="gptq", scale_dtype="bfloat16", bias=True)
    kernel = build_kernel(spec, 64, 256, "gemv", GemvConfig(rows=2, k_threads=8, words=2, split_k=2), "lop3", (1, 8),
                          cuda_device("sm_90"))
    kernel.save(str(tmp_path))
    loaded = load_kernel(str(tmp_path))
    for field in ("spec", "n", "k", "template", "config", "arch", "m_range", "source", "launches"):
        assert getattr(loaded, field) == getattr(kernel, field), field
    assert loaded.binary == kernel.binary
    script = ("import sys; from bitkern.codegen.cuda.kernel import load_kernel; "
              f"k = load_kernel({str(tmp_path)!r}); "
              "assert not [m for m in sys.modules if m.split('.')[0] in ('tvm', 'tvm_ffi')], 'TVM was imported'; "
              "print(len(k.launches))")
    repository = str(Path(__file__).resolve().parents[3])  # this checkout's bitkern (tests/codegen/cuda/ is three below)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=str(tmp_path),
                            env={**os.environ, "PYTHONPATH": repository})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2"


def test_bfloat16_intrinsics_are_the_float16_ones_with_the_type_substituted():
    """The bfloat16 ldmatrix / mma intrinsics come from TVM's float16 ones through a script round trip.
    Retyping the float16 ones to float16 gives them back, up to the static type of ldmatrix's shared
    pointer argument (the code generator takes the element type from its type_annotation argument)."""
    from tvm.s_tir import TensorIntrin
    from tvm_ffi import get_first_structural_mismatch

    from bitkern.codegen.cuda.intrin import mma_intrinsics, retyped

    f16, bf16 = mma_intrinsics("float16"), mma_intrinsics("bfloat16")
    for f16_name, bf16_name in ((f16.load_a, bf16.load_a), (f16.load_b, bf16.load_b), (f16.compute, bf16.compute)):
        original, variant = TensorIntrin.get(f16_name), TensorIntrin.get(bf16_name)
        for func, bf16_func in ((original.desc, variant.desc), (original.impl, variant.impl)):
            mismatch = get_first_structural_mismatch(retyped(func, "float16"), func)
            assert mismatch is None or str(mismatch[0]).endswith("value.args[5].ty.element_type.dtype"), mismatch
            text = bf16_func.script()
            assert "bfloat16" in text and '"float16"' not in text and '"fp16"' not in text


@pytest.mark.parametrize("n", [1, 8, 15])
def test_gemm_template_refuses_fewer_than_16_output_columns_and_the_kit_leaves_them_out(n):
    """The TensorCore template's schedule fails below one mma tile of N (found by the GPU kit's edge shapes):
    it says so before any build, and the kit's matrix keeps only cases their template serves."""
    from bitkern.gpukit.matrix import correctness_cases

    spec = Matmul("int4", "float16", group_size=-1)
    reason = template_named("gemm").unsupported(spec, n, 64, cuda_device("sm_90"))
    assert reason is not None and f"out_features={n}" in reason and "GEMV" in reason
    assert template_named("gemm").unsupported(spec, 16, 64, cuda_device("sm_90")) is None
    kept = [case for case in correctness_cases() if case.supported_on("sm_90")]
    assert kept and not any(case.template == "gemm" and case.n < 16 for case in kept)


@pytest.mark.parametrize("spec, k, config, message", [
    (Matmul("int4", "int8", accumulate_dtype="int32", group_size=-1, output_dtype="float16"), 512,
     GemmConfig(block_k=64, split_k=2), "split_k with int8 activations"),
    (_float("int4", epilogue="swiglu"), 512, GemmConfig(split_k=2), "split_k with epilogue='swiglu'"),
    (_float("int4"), 384, GemmConfig(block_k=64, split_k=4),
     "block_k=64 x split_k=4 does not divide the padded K=384")])
def test_gemm_split_k_is_refused_where_the_reduce_kernel_cannot_finish_the_sum(spec, k, config, message):
    """int8 / fp8 activations scale the whole sum after it; SwiGLU pairs columns the reduce kernel does not see;
    every K slice must be whole block_k steps."""
    assert message in template_named("gemm").reason(spec, 256, k, config, "sm_90")
