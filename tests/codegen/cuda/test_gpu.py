"""CUDA kernels on a GPU (skipped without one): the decode functions bit-exact on the device, and the GEMM
and GEMV kernels against the float64 reference for every weight type x activation type x zero mode, output
types, split-K, fuzzed shapes (fixed by a seed), edge shapes and the fusion epilogues (against the unfused
computation), the grouped mixture-of-experts GEMV for every type, top_k and routing
(`bitkern.gpukit.matrix.correctness_cases`), torch's current stream and CUDA graphs.  Each case's kernel is one configuration of its template, from the kernel
cache (a GPU kit ships them all; elsewhere they are built, which needs TVM and nvcc).

Run on a GPU machine:  python -m pytest tests/codegen/cuda/test_gpu.py -q   (or a GPU kit's OUT/run)
Memory checking:       compute-sanitizer --tool memcheck python -m pytest tests/codegen/cuda/test_gpu.py -q -k edge
"""

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from bitkern.cache import KernelKey, KernelNotFound, pinned_kernel
from bitkern.cache.key import pinned_name
from bitkern.codegen.cuda import pack
from bitkern.codegen.cuda.compile import nvcc
from bitkern.codegen.cuda.launcher import module
from bitkern.gpukit.matrix import ANY_ROWS, Case, correctness_cases
from bitkern.ttype import torch_dtype
from bitkern.tuner import cuda_device
from tests.helpers import (DECODERS, OUTPUT_EPS, assert_within_epilogue_bound, decode_cases, device_source,
                           epilogue_bound, expected_decode, pack_words, raw_bits)

pytestmark = pytest.mark.requires_cuda

WEIGHT_EPS = {"float32": 2.0**-22, "float16": 2.0**-11, "bfloat16": 2.0**-8, "int8": 0.0, "float8_e4m3": 2.0**-10}


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    if arch not in ("sm_80", "sm_86", "sm_89", "sm_90"):
        pytest.skip(f"bitkern's CUDA kernels target sm_80 to sm_90, not {arch}")
    return arch


def _kernel(case: Case, spec, arch: str):
    """The case's configuration of its template for `arch`, from the kernel cache."""
    if not case.supported_on(arch):  # float8_e4m3 mma below sm_89; SwiGLU in the GEMV
        pytest.skip(f"the {case.template} template does not serve {spec} on {arch}")
    config = case.config(spec, arch)
    if config is None:
        pytest.skip(f"no {case.template} configuration builds {spec} with N={case.n}, K={case.k}")
    try:
        return pinned_kernel(spec, case.n, case.k, ANY_ROWS, "lop3", cuda_device(), case.template, config)
    except KernelNotFound:
        key = KernelKey(spec, case.n, case.k, ANY_ROWS, "lop3", cuda_device().key, pinned_name(case.template, config))
        failed = _kit_build_failures().get(json.dumps(key.to_dict(), sort_keys=True))
        if failed:
            pytest.fail(f"the GPU kit could not build this kernel: {failed}")
        raise


def _kit_build_failures() -> dict:
    """{key as JSON: error} of the kernels a GPU kit running these tests failed to build (none elsewhere)."""
    manifest = Path(os.environ.get("BITKERN_KIT_DIR", "")) / "kit.json"
    if not os.environ.get("BITKERN_KIT_DIR") or not manifest.is_file():
        return {}
    return {json.dumps(item["key"], sort_keys=True): item["error"]
            for item in json.loads(manifest.read_text()).get("failed", [])}


def _check(spec, q, x, bias, y, residual=None):
    """|z - ref| <= (eps_w + K·2^-21)·Σ|x||w| for the sums z = x·Wᵀ + b: the weight's rounding to the mma input
    type, float32 accumulation in any order; then eps_out·|ref| for the output cast, or for a fused epilogue (and
    residual) that bound of z carried through it against the unfused float64 computation (`epilogue_bound`; exp
    and division within 2^-20 of |z|)."""
    x, bias = x.cpu(), None if bias is None else bias.cpu()
    reference = spec.exact(x, q, bias, residual)
    magnitude = x.double().abs() @ q.dequantize(torch.float64).abs().T
    bound_z = (WEIGHT_EPS[spec.activation_dtype] + q.shape[1] * 2.0**-21) * magnitude
    if spec.epilogue == "none" and not spec.residual:
        bound = bound_z + OUTPUT_EPS[spec.output_dtype] * reference.abs() + 1e-30
    else:
        z = dataclasses.replace(spec, epilogue="none", residual=False).exact(x, q, bias)
        bound = epilogue_bound(spec, z, bound_z + 2.0**-23 * z.abs(), reference, approximation=2.0**-20)
    assert_within_epilogue_bound(spec, y, reference, bound)


@pytest.mark.parametrize("case", [case for case in correctness_cases() if not case.experts], ids=str)
def test_kernel_matches_the_float64_reference(case):
    """Every case: y within the bound of the float64 reference, element by element."""
    arch = _arch()
    spec, q, x, b, r = case.inputs()
    kernel = _kernel(case, spec, arch)
    packed = pack(q).to("cuda")
    y = kernel(x.cuda().contiguous(), packed, None if b is None else b.cuda(), None if r is None else r.cuda())
    torch.cuda.synchronize()
    _check(spec, q, x, b, y, r)


@pytest.mark.parametrize("case", [case for case in correctness_cases() if case.experts], ids=str)
def test_grouped_kernel_matches_the_float64_reference(case):
    """Every grouped (mixture-of-experts) case: y [M, top_k, N] within the bound of the float64 reference per (row,
    expert) pair, element by element: (eps_w + K·2^-21)·Σ|x||w_e| for the sums, eps_out·|ref| for the output cast."""
    arch = _arch()
    spec, q, x, b, _ = case.inputs()
    indices = case.indices()
    kernel = _kernel(case, spec, arch)
    y = kernel(x.cuda().contiguous(), pack(q).to("cuda"), None if b is None else b.cuda(), indices=indices.cuda())
    torch.cuda.synchronize()
    reference = spec.exact(x, q, indices, b)
    experts = q.dequantize(torch.float64).abs().view(spec.experts, -1, q.shape[1])
    magnitude = torch.einsum("mk,mjnk->mjn", x.double().abs(), experts[indices])
    bound = (WEIGHT_EPS[spec.activation_dtype] + q.shape[1] * 2.0**-21) * magnitude + \
        OUTPUT_EPS[spec.output_dtype] * reference.abs() + 1e-30
    assert tuple(y.shape) == tuple(reference.shape) and y.dtype == torch_dtype(spec.output_dtype)
    excess = (y.double().cpu() - reference).abs() - bound
    assert float(excess.max()) <= 0, f"max excess {float(excess.max()):.3g}"


def test_launch_follows_torch_streams_and_cuda_graphs():
    arch = _arch()
    case = Case("stream", "gemv", "uint4", 256, 512, 8, "float16", "gptq")  # the kernel of the "types" case
    spec, q, x, b, _ = case.inputs()
    kernel = _kernel(case, spec, arch)
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
    loaded = module(_decode_cubin(arch), torch.cuda.current_device())
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


def _decode_cubin(arch: str) -> bytes:
    """The decode kernels' cubin: a GPU kit's (built from the same source), else compiled here with nvcc."""
    shipped = Path(os.environ.get("BITKERN_KIT_DIR", "")) / f"decode-{arch}.cubin"
    if os.environ.get("BITKERN_KIT_DIR") and shipped.is_file():
        return shipped.read_bytes()
    return nvcc(device_source(DECODERS), arch).cubin
