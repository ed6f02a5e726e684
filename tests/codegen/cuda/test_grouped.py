"""The CUDA grouped (mixture-of-experts) GEMV without a GPU: its kernels lower with TVM and compile with nvcc for sm_80
and sm_90 for every weight-type family the GEMV serves, and their PTX holds what the template is built around (the
expert id loaded from `indices`, 128- or 64-bit weight loads, the LOP3 decode where the GEMV has it, warp shuffles);
the tensor expression it schedules, built unscheduled for the host CPU, matches `GroupedMatmul`'s float64 reference
for top_k 1 to 8, experts without tokens, one expert taking every token and fuzzed routings; the kernel's calls are
planned and rehearsed up to the driver."""

import random
import re

import pytest
import torch

import bitkern
from bitkern.codegen import build_kernel, template as template_named
from bitkern.codegen.cuda import GroupedGemvConfig
from bitkern.codegen.cuda.compile import evaluate, lower, nvcc
from bitkern.codegen.cuda.expr import decoder_for
from bitkern.codegen.cuda.grouped import grouped_expr
from bitkern.codegen.cuda.layout import to_lop3
from bitkern.ops import Matmul
from bitkern.ops.grouped import GroupedMatmul
from bitkern.tuner import cuda_device
from tests.codegen.cuda.test_codegen import _entries

pytestmark = pytest.mark.requires_nvcc

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}
EPS = {"float32": 2.0**-23, "float16": 2.0**-11, "bfloat16": 2.0**-8, "int8": 0.0}
OUTPUT_EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def _grouped(weight, activation="float16", experts=8, top_k=2, group=128, zero_mode="none", **options):
    """A grouped spec with the scale storage its activation takes (as the dense CUDA tests' `_float`)."""
    if activation == "int8":
        options.setdefault("accumulate_dtype", "int32")
        options.setdefault("output_dtype", "float16")
    scale = "bfloat16" if activation == "bfloat16" and "fp" not in weight else "float16"
    return GroupedMatmul(weight, activation, group_size=group, zero_mode=zero_mode, scale_dtype=scale, experts=experts,
                         top_k=top_k, **options)


CASES = {  # name: (spec, N, K, config)
    "int4_f16": (_grouped("int4", bias=True), 256, 512, GroupedGemvConfig(k_threads=16)),
    "int4_bf16_top8": (_grouped("int4", "bfloat16", experts=16, top_k=8), 128, 1024, GroupedGemvConfig()),
    "uint4_gptq_f16": (_grouped("uint4", zero_mode="gptq", bias=True), 128, 512, GroupedGemvConfig(k_threads=16)),
    "uint4_hqq_f32out": (_grouped("uint4", zero_mode="hqq", output_dtype="float32"), 64, 512,
                         GroupedGemvConfig(k_threads=8, words=2)),
    "nf4_f16": (_grouped("nf4", group=64), 96, 256, GroupedGemvConfig(k_threads=8)),
    "int8_f16": (_grouped("int8", top_k=1), 128, 512, GroupedGemvConfig(k_threads=8, words=2)),
    "int2_bf16": (_grouped("int2", "bfloat16"), 128, 1024, GroupedGemvConfig(k_threads=16, words=2)),
    "fp4_f16": (_grouped("fp4_e2m1"), 128, 512, GroupedGemvConfig(k_threads=16)),
    "e4m3_f16": (_grouped("float8_e4m3"), 64, 256, GroupedGemvConfig(k_threads=8, words=2)),
    "mxfp4_bf16": (_grouped("mxfp4", "bfloat16", group=32, bias=True), 128, 1024, GroupedGemvConfig(k_threads=8)),
    "uint2_awq_f32": (_grouped("uint2", "float32", group=64, zero_mode="awq"), 64, 1024,
                      GroupedGemvConfig(k_threads=16)),
    "int4_int8": (_grouped("int4", "int8", group=-1, bias=True), 128, 512, GroupedGemvConfig(k_threads=16)),
    "int2_group8_tir_f16": (_grouped("int2", group=8), 64, 512, GroupedGemvConfig(k_threads=8, words=1,
                                                                                   decode="tir")),
}
ARCHS = ("sm_80", "sm_90")


@pytest.fixture(scope="module", params=ARCHS)
def compiled(request):
    """(arch, launches per case, binary, PTX per kernel) of every case for one architecture: one nvcc call."""
    arch = request.param
    template = template_named("grouped_gemv")
    funcs, owners = {}, {}
    for name, (spec, n, k, config) in CASES.items():
        for symbol, func in template.functions(spec, n, k, config, arch, prefix=f"{name}_").items():
            funcs[symbol], owners[symbol] = func, name
    source, launches = lower(funcs, arch)
    binary = nvcc(source, arch)
    by_case = {}
    for symbol, found in launches.items():
        by_case.setdefault(owners[symbol], []).extend(found)
    return arch, by_case, binary, _entries(binary.ptx)


def test_every_case_compiles_to_one_kernel_over_the_pairs(compiled):
    """One launch per case, a block row per (row, expert) pair: grid.y = M·top_k, grid.x the column blocks."""
    arch, launches, binary, entries = compiled
    assert binary.cubin[:4] == b"\x7fELF" and binary.arch == arch
    for name, (spec, n, k, config) in CASES.items():
        (launch,) = launches[name]
        assert launch.name == f"{name}_grouped_gemv_kernel" and launch.name in entries
        assert 0 < binary.registers[launch.name] <= 255 and not binary.spills.get(launch.name)
        assert [evaluate(g, 3) for g in launch.grid] == [n // config.columns, 3 * spec.top_k, 1], name
        assert launch.params[-1] == "M" and {"x", "qweight", "scales", "indices", "y"} <= set(launch.params)
        assert ("bias" in launch.params) == spec.bias and ("zeros" in launch.params) == (spec.zero_mode != "none")


@pytest.mark.parametrize("name", list(CASES))
def test_ptx_loads_the_expert_id_then_decodes_its_words(compiled, name):
    """The expert id is one 64-bit load from indices (once per thread, not per k-step; the output stage's bias
    reads the same id), the weight words come in 128- or 64-bit loads, decoded with lop3 where the dense GEMV's decode
    has it, and the warp's K partial sums meet by shuffles."""
    _, launches, _, entries = compiled
    spec, _, _, config = CASES[name]
    ptx = entries[launches[name][0].name]
    assert len(re.findall(r"ld\.global(\.nc)?\.(u64|s64|b64)", ptx)) == 1
    width = {4: "v4", 2: "v2"}.get(config.words)
    if width:
        assert re.search(rf"ld\.global\.nc\.{width}\.(u32|b32|s32)", ptx), "no vectorized weight load"
    assert ("lop3.b32" in ptx) == (decoder_for(spec).uses_lop3 and config.decode == "lop3")
    assert "shfl.sync" in ptx


def test_gemv_and_grouped_decode_the_same_way(compiled):
    """The grouped kernel is the GEMV's schedule: for the same weight type and configuration its PTX holds the same
    number of lop3 instructions per kernel (the decode functions are the GEMV's), reading scales gathered into
    registers."""
    arch = compiled[0]
    spec, n, k, config = CASES["uint4_gptq_f16"]
    dense = Matmul(**{field: getattr(spec, field) for field in Matmul.__dataclass_fields__})
    gemv = template_named("gemv").functions(dense, n, k, config, arch)
    source, _ = lower(gemv, arch)
    dense_ptx = nvcc(source, arch).ptx
    grouped_ptx = compiled[3][compiled[1]["uint4_gptq_f16"][0].name]
    assert dense_ptx.count("lop3.b32") == grouped_ptx.count("lop3.b32") > 0


def test_refusals_name_the_reason():
    grouped = template_named("grouped_gemv")
    sm_90 = cuda_device("sm_90")
    reason = grouped.unsupported(GroupedMatmul("nvfp4", "float16", group_size=16, experts=4), 64, 256, sm_90)
    assert "nvfp4 (a scale per tensor" in reason
    reason = grouped.unsupported(_grouped("int3"), 64, 256, sm_90)
    assert "'int3' has 3 bits" in reason
    reason = grouped.unsupported(_grouped("int4", experts=4096), 4096, 8192, sm_90)
    assert "indexable in int32" in reason
    assert "split_k=1" in str(pytest.raises(ValueError, GroupedGemvConfig, split_k=2).value)
    assert "rows=1" in str(pytest.raises(ValueError, GroupedGemvConfig, rows=2).value)
    assert "a grouped spec" in template_named("gemv").unsupported_grouping(_grouped("int4"))
    assert "a spec of one weight" in grouped.unsupported_grouping(Matmul("int4", "float16"))


def test_tuner_offers_only_the_grouped_template_for_grouped_specs():
    from bitkern.tuner.space import enumerate_candidates, usable_templates

    sm_90 = cuda_device("sm_90")
    usable, unused = usable_templates(_grouped("int4"), 256, 512, (1, 1), "lop3", sm_90)
    assert [t.name for t in usable] == ["grouped_gemv"] and {"gemm", "gemv", "mma_gemv"} <= set(unused)
    _, candidates = enumerate_candidates(_grouped("int4"), 256, 512, (2, 3), "lop3", sm_90)
    assert candidates and all(c.config.rows == 1 and c.config.split_k == 1 for c in candidates)
    assert {c.config.decode for c in candidates} == {"lop3"}  # the plain-TIR decode only where LOP3 cannot serve
    usable, _ = usable_templates(Matmul("int4", "float16"), 256, 512, (1, 1), "lop3", sm_90)
    assert "grouped_gemv" not in [t.name for t in usable]


def _stack(name, experts, n, k, activation, zero_mode, group, generator):
    """The experts' stacked [E·N, K] weight: quantized by rows (scales per row and group), which is the stack of the
    experts quantized one at a time (as `bitkern.Experts` holds them)."""
    block = bitkern.ttype.get(name).block_size > 1
    scale = torch.bfloat16 if activation == "bfloat16" and "fp" not in name else torch.float16
    return bitkern.quantize(torch.randn(experts * n, k, generator=generator), name,
                            group_size=None if block else group, zero_mode=zero_mode, scale_dtype=scale)


@pytest.fixture(scope="module")
def run_expr(llvm_target):
    """Compile `grouped_expr` unscheduled for the host and run it on (x, stacked weight, indices, bias); `packed`: the
    stacked weight in the lop3 layout as a caller holds it (default: `to_lop3` of the portable one)."""
    import tvm
    from tvm import te

    def run(spec, q, x, indices, bias=None, packed=None):
        n, k = q.shape[0] // spec.experts, q.shape[1]
        expr = grouped_expr(spec, n, k)
        kernel = tvm.compile(tvm.IRModule({"main": te.create_prim_func([*expr.inputs, expr.output])}),
                             target=llvm_target)["main"]
        packed = to_lop3(q) if packed is None else packed
        y = torch.empty(x.shape[0] * spec.top_k, n, dtype=TORCH[spec.output_dtype])
        arguments = [x, packed.qweight, packed.scales] + ([packed.zeros] if packed.zeros is not None else [])
        arguments += [indices.to(torch.int64).contiguous()] + ([bias] if bias is not None else [])
        kernel(*arguments, y)
        return y.view(x.shape[0], spec.top_k, n)

    return run


def _activations(dtype, m, k, generator):
    x = torch.randn(m, k, generator=generator)
    return x.mul(20).round().clamp(-127, 127).to(torch.int8) if dtype == "int8" else x.to(TORCH[dtype])


def _check(spec, q, x, indices, bias, y):
    """|y - ref| <= (eps_w + K·2^-23)·Σ|x||w_e| + eps_out·|ref| per (row, slot) pair against the float64 reference:
    the weight's one rounding to the activation type, float32 sums, the output cast."""
    reference = spec.exact(x, q, indices, bias)
    magnitude = torch.einsum("mk,mjnk->mjn", x.double().abs(),
                             q.dequantize(torch.float64).abs().view(spec.experts, -1, q.shape[1])[indices.long()])
    bound = (EPS[spec.activation_dtype] + q.shape[1] * 2.0**-23) * magnitude + \
        OUTPUT_EPS[spec.output_dtype] * reference.abs() + 1e-30
    assert tuple(y.shape) == tuple(reference.shape)
    excess = (y.double() - reference).abs() - bound
    assert float(excess.max()) <= 0, f"max excess {float(excess.max()):.3g}"


TYPES = [("int4", "none"), ("uint4", "gptq"), ("uint4", "hqq"), ("nf4", "none"), ("int8", "none"), ("int2", "none"),
         ("uint2", "awq"), ("int1", "none"), ("fp4_e2m1", "none"), ("float8_e5m2", "none"), ("mxfp4", "none")]


@pytest.mark.parametrize("name, zero_mode", TYPES)
@pytest.mark.parametrize("activation", ["float16", "bfloat16", "float32"])
def test_expression_matches_the_reference_for_every_type(name, zero_mode, activation, run_expr):
    generator = torch.Generator().manual_seed(len(name) * 7 + len(activation))
    experts, n, k, m = 5, 32, 128, 3
    q = _stack(name, experts, n, k, activation, zero_mode, 32, generator)
    spec = GroupedMatmul.for_weight(q, activation, experts=experts, top_k=2, bias=True, output_dtype="float32")
    x = _activations(activation, m, k, generator)
    indices = torch.tensor([[4, 0], [0, 4], [2, 2]])  # experts 1 and 3 get no tokens; a row picks one twice
    bias = torch.randn(experts, n, generator=generator)
    _check(spec, q, x, indices, bias, run_expr(spec, q, x, indices, bias))


@pytest.mark.parametrize("name, zero_mode", [("int4", "none"), ("uint4", "gptq"), ("int8", "none"), ("int2", "none")])
def test_int8_activations_scale_after_the_sum(name, zero_mode, run_expr):
    generator = torch.Generator().manual_seed(11)
    q = _stack(name, 4, 48, 256, "float16", zero_mode, -1, generator)
    spec = GroupedMatmul.for_weight(q, "int8", accumulate_dtype="int32", experts=4, top_k=3, output_dtype="float32",
                                    bias=True)
    x = _activations("int8", 2, 256, generator)
    indices = torch.tensor([[3, 1, 0], [1, 3, 3]])
    bias = torch.randn(4, 48, generator=generator)
    _check(spec, q, x, indices, bias, run_expr(spec, q, x, indices, bias))


@pytest.mark.parametrize("top_k", range(1, 9))
def test_every_top_k_with_an_expert_left_without_tokens(top_k, run_expr):
    """E = 9 experts, each row's top_k distinct ones drawn from experts 1..8: expert 0 never has a token."""
    generator = torch.Generator().manual_seed(top_k)
    experts, n, k, m = 9, 16, 200, 4  # K ragged against the layout's 128
    q = _stack("int4", experts, n, k, "float16", "none", 40, generator)
    spec = GroupedMatmul.for_weight(q, "float16", experts=experts, top_k=top_k, bias=top_k % 2 == 0)
    x = _activations("float16", m, k, generator)
    indices = torch.stack([torch.randperm(experts - 1, generator=generator)[:top_k] + 1 for _ in range(m)])
    bias = torch.randn(experts, n, generator=generator) if spec.bias else None
    y = run_expr(spec, q, x, indices, bias)
    _check(spec, q, x, indices, bias, y)
    assert not (indices == 0).any()


@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_one_expert_taking_every_token(top_k, run_expr):
    generator = torch.Generator().manual_seed(100 + top_k)
    experts, n, k, m = 8, 32, 256, 6
    q = _stack("nf4", experts, n, k, "bfloat16", "none", 64, generator)
    spec = GroupedMatmul.for_weight(q, "bfloat16", experts=experts, top_k=top_k, bias=True, output_dtype="float32")
    x = _activations("bfloat16", m, k, generator)
    indices = torch.full((m, top_k), 5, dtype=torch.int32)
    bias = torch.randn(experts, n, generator=generator)
    y = run_expr(spec, q, x, indices, bias)
    _check(spec, q, x, indices, bias, y)
    assert torch.equal(y[:, :1].expand_as(y), y)  # every slot is the same expert's product


FUZZ_SEED, FUZZ_CASES = 4242, 12


@pytest.mark.parametrize("case", range(FUZZ_CASES))
def test_fuzzed_routings(case, run_expr):
    """Random experts (2..12), top_k, rows, shapes (N a multiple of 16, any K that words fill), types and routings
    with repeats, fixed by a seed."""
    fuzz = random.Random(FUZZ_SEED + case)
    experts = fuzz.randint(2, 12)
    top_k, m = fuzz.randint(1, min(8, experts)), fuzz.randint(1, 7)
    n, k = 16 * fuzz.randint(1, 6), 8 * fuzz.randint(1, 40)
    name, zero_mode = fuzz.choice([("int4", "none"), ("uint4", "gptq"), ("nf4", "none"), ("int2", "none"),
                                   ("fp4_e2m1", "none"), ("int8", "none")])
    activation = fuzz.choice(["float16", "bfloat16"])
    generator = torch.Generator().manual_seed(case)
    q = _stack(name, experts, n, k, activation, zero_mode, -1, generator)
    spec = GroupedMatmul.for_weight(q, activation, experts=experts, top_k=top_k, bias=fuzz.random() < 0.5)
    x = _activations(activation, m, k, generator)
    indices = torch.tensor([[fuzz.randrange(experts) for _ in range(top_k)] for _ in range(m)])
    bias = torch.randn(experts, n, generator=generator) if spec.bias else None
    _check(spec, q, x, indices, bias, run_expr(spec, q, x, indices, bias))


def test_planned_call_packs_the_routing_and_the_experts_bias(tmp_path):
    """A built kernel's plan: y [M, top_k, N], int32 expert ids passed as int64, the [E, N] bias as E·N float32, the
    launches matching the cubin; saved and loaded back (no TVM) it is a grouped kernel of the same spec."""
    from bitkern.codegen.cuda import load_kernel
    from bitkern.codegen.cuda.grouped import GroupedCudaKernel
    from bitkern.codegen.cuda.launcher import check_launches

    sm_90 = cuda_device("sm_90")
    generator = torch.Generator().manual_seed(3)
    q = _stack("int4", 4, 64, 256, "float16", "none", 128, generator)
    spec = GroupedMatmul.for_weight(q, "float16", experts=4, top_k=2, bias=True)
    kernel = build_kernel(spec, 64, 256, "grouped_gemv", GroupedGemvConfig(k_threads=8, warps=2), "lop3", (1, 8),
                          sm_90)
    kernel.save(str(tmp_path))
    loaded = load_kernel(str(tmp_path))
    assert isinstance(loaded, GroupedCudaKernel) and loaded.spec == spec and loaded.config == kernel.config
    x = torch.randn(3, 256, generator=generator).half()
    indices = torch.tensor([[0, 3], [3, 3], [1, 2]], dtype=torch.int32)
    bias = torch.randn(4, 64, generator=generator)
    y, calls = loaded.plan(x, to_lop3(q), bias, indices=indices)
    assert y.shape == (3, 2, 64) and y.dtype == torch.float16
    (call,) = calls
    check_launches(loaded.binary.cubin, calls, sm_90.shared_bytes_per_block)
    held = {id(t): t for t in call.keep}
    routing = next(t for t in held.values() if t.dtype == torch.int64)
    assert torch.equal(routing, indices.long()) and call.grid[1] == 6
    assert any(t.dtype == torch.float32 and t.shape == (256,) and torch.equal(t, bias.reshape(-1))
               for t in held.values())
    with pytest.raises(ValueError, match=r"indices must be a \[3, top_k=2\] tensor"):
        loaded.plan(x, to_lop3(q), bias, indices=indices[:, :1])
    with pytest.raises(ValueError, match="40000 rows: 80000 .row, expert. pairs of 64 outputs; a grouped kernel serves "
                                         "up to 65535 pairs"):
        loaded.plan(torch.zeros(40000, 256).half(), to_lop3(q), bias, indices=torch.zeros(40000, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="this kernel runs on CUDA devices"):
        loaded(x, to_lop3(q), bias, indices=indices)


def test_grouped_calls_are_rehearsed_up_to_the_driver(tmp_path):
    """`GroupedMatmul` called on host tensors inside a rehearsal for sm_90: the tuner's grouped kernel is found, y is
    [M, top_k, N] and the launch carries the routing, checked against the cubin."""
    from bitkern.cache import DiskStore
    from bitkern.cache.dispatch import rehearsal

    generator = torch.Generator().manual_seed(5)
    q = _stack("uint4", 6, 32, 256, "float16", "gptq", 128, generator)
    spec = GroupedMatmul.for_weight(q, "float16", experts=6, top_k=2, output_dtype="float32")
    x = torch.randn(2, 256, generator=generator).half()
    indices = torch.tensor([[5, 1], [1, 0]])
    with rehearsal(cuda_device("sm_90"), DiskStore(tmp_path)) as launches:
        y = spec(x, bitkern.pack(q), indices)
    assert y.shape == (2, 2, 32) and y.dtype == torch.float32
    (launch,) = launches
    assert launch.name.startswith("grouped_gemv") and launch.grid[1] == 4
    assert ("pointer", indices.data_ptr()) in launch.arguments  # int64 and contiguous: passed as it is
    many = torch.zeros(40000, 256).half()
    with rehearsal(cuda_device("sm_90"), DiskStore(tmp_path / "untouched")) as launches:
        with pytest.raises(ValueError, match="80000 .row, expert. pairs"):
            spec(many, bitkern.pack(q), torch.zeros(40000, 2, dtype=torch.long))
    assert not launches and not list((tmp_path / "untouched").rglob("kernel.cubin"))  # refused before any build


def test_experts_hold_on_cuda_the_stacked_weight_the_kernel_reads(run_expr):
    """A `bitkern.Experts` projection re-laid for CUDA (lop3, as `.to("cuda")` does) gives the grouped kernel its
    experts' buffers seen as one [E·N, K] weight: the same codes, scales and zeros as its experts' portable weights
    stacked, and the kernel's expression on those very tensors matches the float64 reference of the spec the module
    asks for."""
    from bitkern.codegen.cuda import Lop3Weight
    from bitkern.nn import library
    from bitkern.ttype import Layout

    experts = bitkern.Experts(6, 128, 64, dtype="uint4", group_size=32, zero_mode="gptq")
    projection = experts.gate_up
    portable = projection.quantized_weights()
    projection._relayout(Layout.LOP3)
    stacked = projection.stacked_weight()
    assert isinstance(stacked, Lop3Weight) and stacked.shape == (6 * 128, 128)
    q = stacked.to_portable()
    for name in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(q, name), torch.cat([getattr(w, name) for w in portable])), name
    spec = library.grouped_spec_of(library.op_arguments(stacked)[1], torch.float16, torch.float16, False, 6, 2)
    generator = torch.Generator().manual_seed(9)
    x = _activations("float16", 3, 128, generator)
    indices = torch.tensor([[5, 0], [0, 2], [2, 2]])
    _check(spec, q, x, indices, None, run_expr(spec, q, x, indices, packed=stacked))
