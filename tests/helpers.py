"""What several test modules share: error bounds of the CPU kernels against the float64 reference, the
comparison of module outputs, the cases of the CUDA decode functions (the host and the GPU tests run the same
ones), and the benchmark scripts as modules."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import bitkern
from bitkern import ttype
from bitkern.codegen.cuda.decode import Decoder, library
from bitkern.codegen.words import word_order
from bitkern.ops import Matmul
from bitkern.ttype import torch_dtype
from bitkern.tuner import host_cpu

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def benchmark(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is no package), registered as benchmarks_<name> so that its
    dataclasses resolve."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))
    spec.loader.exec_module(module)
    return module


# -- CPU kernels against bitkern.ops references ---------------------------------------------------------------
OUTPUT_EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}
# The bf16 matrix templates, each run where the host can: AMX on AMX CPUs, AVX512-BF16 on CPUs with vdpbf16ps.
MATRIX_TEMPLATES = [pytest.param("amx", marks=pytest.mark.requires_amx, id="amx"),
                    pytest.param("dot", marks=pytest.mark.requires_avx512_bf16, id="dot")]


def matrix_device(template: str):
    """A description of this CPU for which the tuner picks the matrix template `template`: the host itself for
    AMX; for AVX512-BF16, the host as a CPU without AMX (compiled for Cooper Lake, so a Sapphire Rapids host runs
    the kernels, which the tuner gives AMX CPUs none of; on a CPU without AMX this is the host)."""
    cpu = host_cpu()
    if template == "amx":
        return cpu
    return cpu.at_level("avx512-bf16")


def matmul_case(name, n, k, m, activation="bfloat16", output="float32", group=128, zero_mode=None, bias=False,
                seed=0):
    """(spec, quantized weight, x, bias) of a random [N, K] weight of type `name` and M rows."""
    generator = torch.Generator().manual_seed(seed)
    qweight = bitkern.quantize(torch.randn(n, k, generator=generator), name, group_size=group, zero_mode=zero_mode)
    spec = Matmul.for_weight(qweight, activation, bias=bias, output_dtype=output,
                             accumulate_dtype="int32" if activation == "int8" else "float32")
    x = torch.randn(m, k, generator=generator)
    x = x.mul(16).round().clamp(-128, 127).to(torch.int8) if activation == "int8" else x.to(torch_dtype(activation))
    b = torch.randn(n, generator=generator) if bias else None
    return spec, qweight, x, b


def assert_matches_reference(spec, qweight, x, bias, y):
    """y has the spec's dtype and shape and lies within the kernels' error bound of the float64 reference (see
    `assert_within_bound`)."""
    assert y.dtype == torch_dtype(spec.output_dtype) and y.shape == (*x.shape[:-1], qweight.shape[0])
    magnitude = x.double().abs() @ summed_magnitudes(spec, qweight).T
    assert_within_bound(spec, qweight, y, spec.exact(x, qweight, bias), magnitude)


def summed_magnitudes(spec, qweight):
    """|w| plus what the kernels fold out of their sums, per weight element: Σ_k |x|·this bounds the sums."""
    summed = qweight.dequantize(torch.float64).abs()
    scale = qweight.scale_values().double().repeat_interleave(qweight.group_size, 1)
    if qweight.ttype.kind in ("int", "uint") and spec.activation_dtype == "bfloat16":
        summed = summed + 136 * scale
    if qweight.zeros is not None:  # z·s·Σx is subtracted from s·Σx·q: both sums are rounded
        summed = summed + 2 * qweight.zeros.double().abs().repeat_interleave(qweight.group_size, 1) * scale
    return summed


def vnni_magnitudes(qweight):
    """|w| plus what the VNNI kernels fold out of their exact int32 block sums (offsets up to 128·s, zero points), per
    weight element: float32 sums of those within 1e-5 of Σ_k |x̃|·this (x̃: the int8-quantized activations)."""
    scale = qweight.scale_values().double().repeat_interleave(qweight.group_size, 1)
    summed = qweight.dequantize(torch.float64).abs() + 136 * scale
    if qweight.zeros is not None:
        summed = summed + 2 * qweight.zeros.double().abs().repeat_interleave(qweight.group_size, 1) * scale
    return summed


def assert_within_bound(spec, qweight, y, reference, magnitude):
    """|y - reference| <= c·magnitude + eps_out·|reference|: the kernels sum in float32; integer weights with
    bf16 activations may be decoded as 128 + u with the 128·s offset folded out of the sums afterwards, and zero
    points are folded out the same way, so `magnitude` (Σ_k |x|·`summed_magnitudes`) includes them.  c is 2^-8
    for types whose values bf16 rounds (nf4), else 1e-5; eps_out is the output type's rounding."""
    c = 1e-5 if "bfloat16" in qweight.ttype.compute_types else 2.0**-8
    bound = c * magnitude + OUTPUT_EPS[spec.output_dtype] * reference.abs() + 1e-30
    excess = (y.double() - reference).abs() - bound
    assert float(excess.max()) <= 0, f"max excess {float(excess.max()):.3g} over the bound"


# |f'| bounds of the elementwise epilogues: how far an error in z = x·Wᵀ + b can move f(z)
EPILOGUE_LIPSCHITZ = {"none": 1.0, "relu": 1.0, "silu": 1.1, "gelu": 1.13}


def epilogue_bound(spec, z, bound_z, reference, approximation: float = 2e-7):
    """Bound of |y - reference| for a kernel applying `spec`'s epilogue (and residual) to sums z = x·Wᵀ + b
    (float64 [M, N], SwiGLU's in `swiglu_rows` order) that it computes within `bound_z`: the error carried through
    f (|f'|, or SwiGLU's product of silu(gate) and up), f's own approximation (`approximation` relative to |z|:
    the GELU's erf polynomial, a GPU's exp) and the output rounding of the reference."""
    from bitkern.ops.matmul import SWIGLU_BLOCK

    if spec.epilogue == "swiglu":
        pairs, bounds = (t.reshape(z.shape[0], -1, 2, SWIGLU_BLOCK) for t in (z, bound_z))
        gate, up, gate_bound, up_bound = pairs[..., 0, :], pairs[..., 1, :], bounds[..., 0, :], bounds[..., 1, :]
        bound = 1.1 * gate_bound * (up.abs() + up_bound) + torch.nn.functional.silu(gate).abs() * \
            (up_bound + approximation * up.abs())
        bound = bound.reshape(z.shape[0], -1)
    else:
        bound = EPILOGUE_LIPSCHITZ[spec.epilogue] * bound_z + approximation * z.abs()
    return bound + (OUTPUT_EPS[spec.output_dtype] + 1e-6) * reference.abs() + 1e-30


def assert_within_epilogue_bound(spec, y, reference, bound) -> None:
    """y has the spec's dtype and the reference's shape and lies within `bound` of it, element by element."""
    assert tuple(y.shape) == tuple(reference.shape) and y.dtype == torch_dtype(spec.output_dtype)
    excess = (y.double().cpu() - reference).abs() - bound
    assert float(excess.max()) <= 0, f"max excess {float(excess.max()):.3g} over the bound"


def assert_epilogue_matches_reference(spec, qweight, x, bias, residual, y) -> None:
    """A CPU kernel's fused output (`spec`'s epilogue and residual) within the bound of the float64 reference of
    the unfused computation: the plain kernels' bound on z (`assert_within_bound`) carried through the epilogue."""
    z = dataclasses.replace(spec, epilogue="none", residual=False).exact(x, qweight, bias)
    c = 1e-5 if "bfloat16" in qweight.ttype.compute_types else 2.0**-8
    bound_z = c * (x.double().abs() @ summed_magnitudes(spec, qweight).T) + 1e-6 * z.abs() + 1e-6
    reference = spec.exact(x, qweight, bias, residual)
    assert_within_epilogue_bound(spec, y, reference, epilogue_bound(spec, z, bound_z, reference))


def assert_grouped_output_within_bound(spec, weight, bias, y, x, indices, weights, magnitudes, c: float) -> None:
    """A grouped kernel's y with its output stage (SwiGLU on each expert's [gate; up] halves, the weighted top-k sum
    of a combine spec) within the bound of `spec.exact`: each pair's sums z (float64, with bias) bounded by
    c·Σ_k |x|·magnitudes[expert] (x̃ for int8 activations; magnitudes [E, N, K] as the kernel family folds them) and
    1e-6 of |z|, carried through SwiGLU (as `epilogue_bound`) and the weighted float32 sum, plus the output's
    rounding."""
    from bitkern.ops.matmul import quantize_activations

    tokens, top_k = indices.shape
    assert tuple(y.shape) == spec.output_shape(tokens, magnitudes.shape[1]) and y.dtype == torch_dtype(
        spec.output_dtype)
    rows = x if spec.combine else x.repeat_interleave(top_k, 0)  # a row per pair
    plain = dataclasses.replace(spec, epilogue="none", combine=False, top_k=1)
    z = plain.exact(rows, weight, indices.reshape(-1, 1), bias).view(tokens, top_k, -1)
    activations = quantize_activations(rows) if spec.activation_quant == "int8" else rows.double()
    magnitude = torch.einsum("pk,pnk->pn", activations.abs(), magnitudes[indices.reshape(-1).long()])
    bound = c * magnitude.view(tokens, top_k, -1) + 1e-6 * z.abs() + 1e-6
    value = z
    if spec.epilogue == "swiglu":
        (gate, up), (gate_bound, up_bound) = z.chunk(2, -1), bound.chunk(2, -1)
        silu = torch.nn.functional.silu(gate)
        value = silu * up
        bound = 1.1 * gate_bound * (up.abs() + up_bound) + silu.abs() * (up_bound + 2e-7 * up.abs())
    if spec.combine:
        scale = weights.double().unsqueeze(-1)
        bound = (scale.abs() * (bound + 1e-6 * value.abs())).sum(1)
        value = (scale * value).sum(1)
    reference = spec.exact(x, weight, indices, bias, weights)
    assert torch.allclose(reference, value, rtol=1e-12, atol=1e-12)  # the spec's definition, composed by hand
    excess = (y.double() - reference).abs() - (bound + OUTPUT_EPS[spec.output_dtype] * reference.abs() + 1e-30)
    assert float(excess.max()) <= 0, f"max excess {float(excess.max()):.3g} over the bound"


# -- modules ------------------------------------------------------------------------------------------------
def assert_matches(y, reference, tolerance):
    """max |y - reference| within `tolerance` of reference's largest magnitude."""
    assert y.shape == reference.shape and y.dtype == reference.dtype
    y, reference = y.detach().double(), reference.detach().double()
    error = float((y - reference).abs().max() / reference.abs().max())
    assert error <= tolerance, f"relative max error {error:.3g} > {tolerance}"


# -- CUDA decode functions ----------------------------------------------------------------------------------
USER_E3M0 = ttype.register(ttype.floating("bk_test_e3m0", 3, 0,
                                          description="a 4-bit float with no fast path: table decode"))
USER_IEEE8 = ttype.register(ttype.floating("bk_test_ieee8", 4, 3, specials="ieee",
                                          description="an 8-bit IEEE-style float (inf and NaN): table decode"))


def _float_decoders():
    out = []
    for dtype in ("float16", "bfloat16", "float32"):
        scale = "float16" if dtype == "float32" else dtype
        for name in ("int4", "int2", "int1", "int8", "uint4", "uint2", "uint1", "uint8", "nf4", "fp4_e2m1",
                     "float8_e4m3", "float8_e5m2", USER_E3M0.name, USER_IEEE8.name):
            out.append(Decoder(name, dtype, "none", scale))
        for name in ("uint4", "uint2", "uint1", "uint8"):
            out += [Decoder(name, dtype, mode, scale) for mode in ("gptq", "hqq")]
        out += [Decoder(name, dtype, "none", "uint8") for name in ("mxfp4", "mxfp8", "nvfp4")]
    # scales stored in another type than the output: the float32 path
    out += [Decoder("uint4", "bfloat16", "gptq", "float16"), Decoder("int4", "float32", "none", "float32"),
            Decoder("fp4_e2m1", "float16", "none", "bfloat16"), Decoder("uint4", "float16", "awq", "float16")]
    return out


def _exact_decoders():
    out = [Decoder(name, "int8", "none", None) for name in ("int4", "int2", "int1", "int8", "uint4", "uint2", "uint1")]
    out += [Decoder(name, "int8", "gptq", None) for name in ("uint4", "uint2", "uint1")]
    out += [Decoder(name, "float8_e4m3", "none", None) for name in ("int4", "uint4", "int2", "int1", "fp4_e2m1",
                                                                     "float8_e4m3")]
    return out


DECODERS = _float_decoders() + _exact_decoders()


def decoder_call(d: Decoder, scale_types: dict) -> str:
    """The arguments of a call of `d` on word i of `words` into row i of `out`, its scale and zero read from the
    `scales` and `zeros` arrays as `scale_types` (C type per scale dtype) say."""
    args = []
    for role in d.arguments():
        if role == "scale":
            args.append(f"((const {scale_types[d.scale]}*)scales)[i]")
        elif role == "zero":
            args.append(f"((const {scale_types[d.scale] if d.zero_mode == 'hqq' else 'uint8_t'}*)zeros)[i]")
        else:
            args.append(role)
    return ", ".join(["&words[i]", f"(char*)out + i * {torch_dtype(d.out).itemsize * d.per_word}"] + args)


def device_source(decoders) -> str:
    """The decoders and one __global__ run_<name>(count, words, out, scales, zeros, tensor_scale) each, a
    thread per word (the GPU tests run it; here nvcc compiles it)."""
    types = {"float16": "bk_half_arg", "bfloat16": "bk_bf16_arg", "float32": "float", "uint8": "uint8_t"}
    kernels = []
    for d in decoders:
        call = decoder_call(d, types)
        kernels.append(f'extern "C" __global__ void run_{d.name}(int count, const uint32_t* words, void* out, '
                       f'const void* scales, const void* zeros, float tensor_scale) {{\n'
                       f'  int i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < count) {d.name}({call});\n}}\n')
    return library(decoders) + "\n".join(kernels)


def _words(bits: int, seed: int) -> torch.Tensor:
    """Codes [W, C] in natural element order: every code at every element (uniform and rotated words)
    and random words."""
    per_word, top = 32 // bits, 1 << bits
    base = torch.arange(top)
    uniform = base[:, None].expand(top, per_word)
    rotated = (base[:, None] + torch.arange(per_word)[None, :]) % top
    random = torch.randint(0, top, (64, per_word), generator=torch.Generator().manual_seed(seed))
    return torch.cat([uniform, rotated, random])


def pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """One lop3-layout word per row of natural-order codes."""
    mapped = codes[:, word_order(bits)]
    return ttype.pack(mapped, bits).view(-1)


def _scale_patterns(dtype: str) -> torch.Tensor:
    """Scale values spanning every exponent of the storage type (and its subnormals, zero, inf, NaN)."""
    if dtype == "float32":
        return torch.cat([torch.logspace(-30, 30, 200), -torch.logspace(-3, 3, 20), torch.tensor([0.0, 1.0])])
    bits = torch.arange(0, 1 << 16, 193, dtype=torch.int32)
    specials = torch.tensor([0x0000, 0x8000, 0x0001, 0x3C00, 0x7BFF if dtype == "float16" else 0x7F7F, 0x7C00 if
                             dtype == "float16" else 0x7F80, 0xFFFF], dtype=torch.int32)
    return torch.cat([bits, specials]).to(torch.int16).view(torch_dtype(dtype))


def _block_scale_codes(d: Decoder) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8)


def _zeros(d: Decoder) -> torch.Tensor | None:
    if d.zero_mode == "none":
        return None
    if d.zero_mode == "hqq":
        return torch.tensor([0.0, 0.5, 3.25, 7.5, 14.999, -0.125, 255.0]).to(torch_dtype(d.scale))
    top = 1 << d.ttype.bits
    return torch.arange(top, dtype=torch.uint8) if top <= 16 else torch.tensor([0, 1, 127, 128, 200, 255],
                                                                                dtype=torch.uint8)


def decode_cases(d: Decoder):
    """Flattened (codes [calls, C], scales [calls], zeros [calls] or None) over the full product."""
    codes = _words(d.ttype.bits, seed=len(d.name))
    if d.scale is None:
        scales = torch.ones(1)
    elif d.scale == "uint8":
        scales = _block_scale_codes(d)
    else:
        scales = _scale_patterns(d.scale)
    zeros = _zeros(d)
    z_count = 1 if zeros is None else len(zeros)
    w_index = torch.arange(len(codes)).repeat_interleave(len(scales) * z_count)
    s_index = torch.arange(len(scales)).repeat_interleave(z_count).repeat(len(codes))
    z_index = torch.arange(z_count).repeat(len(codes) * len(scales))
    return codes[w_index], scales[s_index], None if zeros is None else zeros[z_index]


def expected_decode(d: Decoder, codes, scales, zeros, tensor_scale):
    t = d.ttype
    if zeros is not None:
        values = codes.float() - zeros.float()[:, None]
    else:
        values = t.decode(codes)
    if d.scale is None:
        return values.to(torch_dtype(d.out))
    if d.scale == "uint8":
        s = ttype.get(t.block_scale).decode(scales)
        if t.tensor_scale:
            s = s * tensor_scale
    else:
        s = scales.float()
    return (values * s[:, None]).to(torch_dtype(d.out))


def raw_bits(tensor):
    """A tensor's bits as integers of its width."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])
