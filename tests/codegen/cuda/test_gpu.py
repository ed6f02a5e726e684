"""CUDA kernels on a GPU (skipped without one): the decode functions bit-exact on the device, and the GEMM
and GEMV kernels against the float64 reference for every weight type x activation type x zero mode,
fuzzed odd shapes, torch's current stream and CUDA graphs.

Run on a GPU machine:  python -m pytest tests/codegen/cuda/test_gpu.py -q
Memory checking:       compute-sanitizer --tool memcheck python -m pytest tests/codegen/cuda/test_gpu.py -q -k edge
"""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bitkern
from bitkern import ttype
from bitkern.codegen import build_kernel
from bitkern.codegen.cuda import GemmConfig, GemvConfig, pack
from bitkern.codegen.cuda import gemm, gemv
from bitkern.codegen.cuda.compile import nvcc
from bitkern.codegen.cuda.launcher import module
from bitkern.ops import Matmul
from bitkern.ttype import torch_dtype
from bitkern.tuner import cuda_device
from tests.helpers import DECODERS, OUTPUT_EPS, decode_cases, device_source, expected_decode, pack_words, raw_bits

TEMPLATES = {"gemm": gemm.TEMPLATE, "gemv": gemv.TEMPLATE}

pytestmark = [pytest.mark.requires_cuda, pytest.mark.requires_nvcc]

WEIGHT_EPS = {"float32": 2.0**-22, "float16": 2.0**-11, "bfloat16": 2.0**-8, "int8": 0.0, "float8_e4m3": 2.0**-10}


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    if arch not in ("sm_80", "sm_86", "sm_89", "sm_90"):
        pytest.skip(f"bitkern's CUDA kernels target sm_80 to sm_90, not {arch}")
    return arch


GEMM_CONFIGS = [GemmConfig(), GemmConfig(block_k=64), GemmConfig(block_m=32, warp_m=16, block_n=64, warp_n=32),
                GemmConfig(block_m=16, warp_m=16, block_n=32, warp_n=16, block_k=64, stages=2),
                GemmConfig(block_m=16, warp_m=16, block_n=16, warp_n=16, block_k=128, stages=2)]
GEMV_CONFIGS = [GemvConfig(), GemvConfig(rows=4, k_threads=16, words=2), GemvConfig(k_threads=8, words=1),
                GemvConfig(k_threads=4, words=1, warps=2), GemvConfig(k_threads=1, words=1, warps=1)]


def _kernel(spec, n, k, template, arch, m_range=(1, 1 << 30), prefer=None):
    """The first configuration of the template that fits the shape (a stand-in for the tuner); the LOP3
    decode first, the plain-TIR one for group sizes it cannot serve."""
    configs = ([prefer] if prefer else []) + (GEMM_CONFIGS if template == "gemm" else GEMV_CONFIGS)
    candidates = configs + [dataclasses.replace(config, decode="tir") for config in configs]
    for config in candidates:
        reason = TEMPLATES[template].reason(spec, n, k, config, arch)
        if reason is None:
            return build_kernel(spec, n, k, template, config, "lop3", m_range, cuda_device(arch))
    pytest.skip(f"no {template} configuration fits {spec} with N={n}, K={k}: {reason}")


def _case(name, n, k, m, activation, zero_mode="none", group=128, bias=True, output=None, seed=0):
    generator = torch.Generator().manual_seed(seed)
    t = ttype.get(name)
    scale = torch.bfloat16 if activation == "bfloat16" else torch.float16
    q = bitkern.quantize(torch.randn(n, k, generator=generator), name, group_size=None if t.block_size > 1 else group,
                         zero_mode=zero_mode, scale_dtype=scale)
    options = {"accumulate_dtype": "int32"} if activation == "int8" else {}
    spec = Matmul.for_weight(q, activation, bias=bias, output_dtype=output, **options)
    x = torch.randn(m, k, generator=generator)
    if activation == "int8":
        x = x.mul(20).round().clamp(-127, 127).to(torch.int8)
    else:
        x = x.to(torch_dtype(activation))
    b = torch.randn(n, generator=generator) if bias else None
    return spec, q, x, b


def _check(spec, q, x, bias, y):
    """|y - ref| <= (eps_w + K·2^-21)·Σ|x||w| + eps_out·|ref|: the weight's rounding to the mma input type,
    float32 accumulation in any order, the output cast."""
    assert y.dtype == torch_dtype(spec.output_dtype) and tuple(y.shape) == (x.shape[0], q.shape[0])
    reference = spec.exact(x.cpu(), q, None if bias is None else bias.cpu())
    magnitude = x.cpu().double().abs() @ q.dequantize(torch.float64).abs().T
    bound = (WEIGHT_EPS[spec.activation_dtype] + q.shape[1] * 2.0**-21) * magnitude + \
        OUTPUT_EPS[spec.output_dtype] * reference.abs() + 1e-30
    excess = (y.cpu().double() - reference).abs() - bound
    assert float(excess.max()) <= 0, f"max excess {float(excess.max()):.3g} over the bound"


def _run(template, name, n, k, m, activation, zero_mode="none", group=128, bias=True, seed=0, output=None,
         prefer=None):
    arch = _arch()
    spec, q, x, b = _case(name, n, k, m, activation, zero_mode, group, bias, output, seed)
    kernel = _kernel(spec, n, k, template, arch, prefer=prefer)
    packed = pack(q).to("cuda")
    y = kernel(x.cuda().contiguous(), packed, None if b is None else b.cuda())
    torch.cuda.synchronize()
    _check(spec, q, x, b, y)


FLOAT_WEIGHTS = [("int4", "none"), ("int2", "none"), ("int1", "none"), ("int8", "none"), ("nf4", "none"),
                 ("fp4_e2m1", "none"), ("float8_e4m3", "none"), ("float8_e5m2", "none"), ("mxfp4", "none"),
                 ("mxfp8", "none"), ("nvfp4", "none")]
FLOAT_WEIGHTS += [(name, zero) for name in ("uint4", "uint2", "uint1", "uint8") for zero in ("gptq", "awq", "hqq")]


@pytest.mark.parametrize("name, zero_mode", FLOAT_WEIGHTS)
@pytest.mark.parametrize("activation", ["float16", "bfloat16"])
@pytest.mark.parametrize("template, m", [("gemm", 67), ("gemv", 3)])
def test_every_weight_type_with_float_activations(template, m, name, zero_mode, activation):
    _run(template, name, 256, 512, m, activation, zero_mode)


@pytest.mark.parametrize("name, zero_mode", [("int4", "none"), ("uint4", "gptq"), ("uint4", "awq"), ("int2", "none"),
                                             ("uint2", "gptq"), ("int1", "none"), ("int8", "none")])
@pytest.mark.parametrize("template, m", [("gemm", 40), ("gemv", 2)])
def test_int8_activations(template, m, name, zero_mode):
    _run(template, name, 256, 512, m, "int8", zero_mode, group=-1, output="float16")


@pytest.mark.parametrize("name", ["fp4_e2m1", "int4", "uint4", "float8_e4m3"])
def test_float8_activations(name):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8_e4m3 mma needs sm_89 or newer")
    _run("gemm", name, 256, 512, 33, "float8_e4m3", group=-1, output="bfloat16")


@pytest.mark.parametrize("template", ["gemm", "gemv"])
def test_plain_tir_decode_for_small_groups(template):
    _run(template, "int1", 128, 256, 5, "float16", group=16)


def test_float32_activations_in_the_gemv():
    _run("gemv", "uint4", 128, 512, 3, "float32", "gptq", output="float32")


@pytest.mark.parametrize("rows, m", [(1, 1), (2, 5), (4, 4)])
def test_gemv_split_k(rows, m):
    _run("gemv", "uint4", 512, 4096, m, "float16", "gptq",
         prefer=GemvConfig(rows=rows, split_k=4, k_threads=8))


@pytest.mark.parametrize("template", ["gemm", "gemv"])
@pytest.mark.parametrize("output", ["float32", "float16", "bfloat16"])
def test_output_types(template, output):
    _run(template, "int4", 128, 256, 9, "float16", output=output)


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(["int4", "uint4", "nf4", "int2", "fp4_e2m1"]), n=st.integers(1, 200),
       k_words=st.integers(1, 40), m=st.integers(1, 150), template=st.sampled_from(["gemm", "gemv"]),
       seed=st.integers(0, 1000))
def test_fuzzed_shapes(name, n, k_words, m, template, seed):
    k = 8 * k_words  # per-channel scales: any K that words of codes fill
    zero_mode = "gptq" if name == "uint4" else "none"
    _run(template, name, n, k, m, "float16", zero_mode, group=-1, bias=seed % 2 == 0, seed=seed)


@pytest.mark.parametrize("template", ["gemm", "gemv"])
def test_edge_shapes(template):
    """Smallest and ragged shapes (for compute-sanitizer's memcheck)."""
    for n, k, m in [(1, 8, 1), (17, 40, 3), (16, 128, 65), (130, 136, 129)]:
        _run(template, "int4", n, k, m, "float16", group=-1)


def test_launch_follows_torch_streams_and_cuda_graphs():
    arch = _arch()
    spec, q, x, b = _case("uint4", 256, 512, 8, "float16", "gptq")
    kernel = _kernel(spec, 256, 512, "gemv", arch)
    packed, x, b = pack(q).to("cuda"), x.cuda(), b.cuda()
    expected = kernel(x, packed, b)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_side = kernel(x, packed, b)
    side.synchronize()
    assert torch.equal(on_side, expected)
    graph = torch.cuda.CUDAGraph()
    static_x = x.clone()
    kernel(static_x, packed, b)  # warm up (module load) outside the capture
    with torch.cuda.graph(graph):
        captured = kernel(static_x, packed, b)
    static_x.copy_(x * 2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(captured.float(), kernel(x * 2, packed, b).float())


def test_device_decode_is_bit_exact():
    """The decode functions compiled for the GPU (lop3 asm, half2 / bfloat162 arithmetic) give the
    reference's bits on the same cases as the host test."""
    arch = _arch()
    decoders = DECODERS
    loaded = module(nvcc(device_source(decoders), arch).cubin, torch.cuda.current_device())
    stream = torch.cuda.current_stream().cuda_stream
    for d in decoders:
        codes, scales, zeros = decode_cases(d)
        words = pack_words(codes, d.ttype.bits).cuda()
        out = torch.empty(len(codes), d.per_word, dtype=torch_dtype(d.out), device="cuda")
        scale_arg = scales.contiguous().cuda() if d.scale is not None else None
        zero_arg = zeros.contiguous().cuda() if zeros is not None else None
        tensor_scale = 0.0117
        arguments = [("int32", len(codes)), ("pointer", words.data_ptr()), ("pointer", out.data_ptr()),
                     ("pointer", scale_arg.data_ptr() if scale_arg is not None else 0),
                     ("pointer", zero_arg.data_ptr() if zero_arg is not None else 0),
                     ("float32", tensor_scale)]
        loaded.launch(f"run_{d.name}", ((len(codes) + 255) // 256, 1, 1), (256, 1, 1), 0, stream, arguments)
        torch.cuda.synchronize()
        expected = expected_decode(d, codes, scales, zeros, torch.tensor(tensor_scale, dtype=torch.float32))
        out = out.cpu()
        if out.dtype.is_floating_point:
            nan = torch.isnan(expected.float())
            assert torch.equal(torch.isnan(out.float()), nan), d.name
            assert torch.equal(raw_bits(out)[~nan], raw_bits(expected)[~nan]), d.name
        else:
            assert torch.equal(out, expected), d.name
