"""The CUDA decode functions, compiled for the host by g++, are bit-exact against the torch reference
(`TType.decode`, then (v - z) · s in float32 and one rounding) for every code at every word position,
every integer zero point, and a spread of scale bit patterns covering every exponent."""

import ctypes
import shutil
import subprocess

import pytest
import torch

from bitkern import ttype
from bitkern.codegen.cuda.decode import Decoder, library
from bitkern.codegen.cuda.layout import to_lop3, word_order

TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8,
         "float8_e4m3": torch.float8_e4m3fn, "uint8": torch.uint8}
TVM = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.int8: "int8",
       torch.float8_e4m3fn: "float8_e4m3fn", torch.uint8: "uint8", "float16": "float16", "bfloat16": "bfloat16",
       "float32": "float32", "uint8": "uint8"}
C_TYPES = {"float16": "uint16_t", "bfloat16": "uint16_t", "float32": "float", "uint8": "uint8_t"}
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


def _wrapper(d: Decoder) -> str:
    """extern "C" run_<name>(count, words, out, scales, zeros, tensor_scale): one call per word."""
    out_bytes = TORCH[d.out].itemsize * d.per_word
    args = []
    for a in d.arguments():
        if a == "scale":
            args.append(f"((const {C_TYPES[d.scale]}*)scales)[i]")
        elif a == "zero":
            args.append(f"((const {C_TYPES[d.scale] if d.zero_mode == 'hqq' else 'uint8_t'}*)zeros)[i]")
        else:
            args.append(a)
    call = ", ".join(["&words[i]", f"(char*)out + i * {out_bytes}"] + args)
    return (f'extern "C" void run_{d.name}(long count, const uint32_t* words, void* out, const void* scales, '
            f'const void* zeros, float tensor_scale) {{\n'
            f'  for (long i = 0; i < count; ++i) {d.name}({call});\n}}\n')


def device_source(decoders) -> str:
    """The decoders and one __global__ run_<name>(count, words, out, scales, zeros, tensor_scale) each, a
    thread per word (the GPU tests run it; here nvcc compiles it)."""
    types = {"float16": "bk_half_arg", "bfloat16": "bk_bf16_arg", "float32": "float", "uint8": "uint8_t"}
    kernels = []
    for d in decoders:
        out_bytes = TORCH[d.out].itemsize * d.per_word
        args = []
        for role in d.arguments():
            if role == "scale":
                args.append(f"((const {types[d.scale]}*)scales)[i]")
            elif role == "zero":
                args.append(f"((const {types[d.scale] if d.zero_mode == 'hqq' else 'uint8_t'}*)zeros)[i]")
            else:
                args.append(role)
        call = ", ".join(["&words[i]", f"(char*)out + i * {out_bytes}"] + args)
        kernels.append(f'extern "C" __global__ void run_{d.name}(int count, const uint32_t* words, void* out, '
                       f'const void* scales, const void* zeros, float tensor_scale) {{\n'
                       f'  int i = blockIdx.x * blockDim.x + threadIdx.x;\n  if (i < count) {d.name}({call});\n}}\n')
    return library(decoders) + "\n".join(kernels)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_device_branch_compiles_with_nvcc(arch):
    """Every decoder's device code (PTX lop3, half2 / bfloat162 intrinsics) compiles; lop3 is in the PTX of
    exactly the decoders that use it."""
    import re

    from bitkern.codegen.cuda.compile import find_nvcc, nvcc

    if find_nvcc() is None:
        pytest.skip("nvcc is not installed")
    ptx = nvcc(device_source(DECODERS), arch).ptx
    entries = {m.group(1): m.start() for m in re.finditer(r"\.entry\s+(\w+)\s*\(", ptx)}
    bounds = sorted(entries.values()) + [len(ptx)]
    for d in DECODERS:
        start = entries[f"run_{d.name}"]
        body = ptx[start:bounds[bounds.index(start) + 1]]
        assert ("lop3.b32" in body) == d.uses_lop3, d.name


@pytest.fixture(scope="module")
def host_library(tmp_path_factory):
    """All DECODERS compiled for the host with g++ (the emulation branch of the same source)."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ is not installed")
    directory = tmp_path_factory.mktemp("decode")
    source = directory / "decode.cpp"
    source.write_text(library(DECODERS) + "\n".join(_wrapper(d) for d in DECODERS))
    target = directory / "decode.so"
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", str(target), str(source)], check=True,
                   capture_output=True, text=True)
    return ctypes.CDLL(str(target))


def _words(bits: int, seed: int) -> torch.Tensor:
    """Codes [W, C] in natural element order: every code at every element (uniform and rotated words)
    and random words."""
    per_word, top = 32 // bits, 1 << bits
    base = torch.arange(top)
    uniform = base[:, None].expand(top, per_word)
    rotated = (base[:, None] + torch.arange(per_word)[None, :]) % top
    random = torch.randint(0, top, (64, per_word), generator=torch.Generator().manual_seed(seed))
    return torch.cat([uniform, rotated, random])


def _pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
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
    return torch.cat([bits, specials]).to(torch.int16).view(TORCH[dtype])


def _block_scale_codes(d: Decoder) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8)


def _zeros(d: Decoder) -> torch.Tensor | None:
    if d.zero_mode == "none":
        return None
    if d.zero_mode == "hqq":
        return torch.tensor([0.0, 0.5, 3.25, 7.5, 14.999, -0.125, 255.0]).to(TORCH[d.scale])
    top = 1 << d.ttype.bits
    return torch.arange(top, dtype=torch.uint8) if top <= 16 else torch.tensor([0, 1, 127, 128, 200, 255],
                                                                                dtype=torch.uint8)


def _cases(d: Decoder):
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


def _expected(d: Decoder, codes, scales, zeros, tensor_scale):
    t = d.ttype
    if zeros is not None:
        values = codes.float() - zeros.float()[:, None]
    else:
        values = t.decode(codes)
    if d.scale is None:
        return values.to(TORCH[d.out])
    if d.scale == "uint8":
        s = ttype.get(t.block_scale).decode(scales)
        if t.tensor_scale:
            s = s * tensor_scale
    else:
        s = scales.float()
    return (values * s[:, None]).to(TORCH[d.out])


def _bits(tensor):
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[tensor.element_size()])


@pytest.mark.parametrize("decoder", DECODERS, ids=lambda d: d.name)
def test_host_decode_is_bit_exact(decoder, host_library):
    d = decoder
    codes, scales, zeros = _cases(d)
    words = _pack_words(codes, d.ttype.bits)
    out = torch.empty(len(codes), d.per_word, dtype=TORCH[d.out])
    tensor_scale = 0.0117
    scale_arg = scales.contiguous() if d.scale is not None else None
    zero_arg = zeros.contiguous() if zeros is not None else None
    run = getattr(host_library, f"run_{d.name}")
    run(ctypes.c_long(len(codes)), ctypes.c_void_p(words.data_ptr()), ctypes.c_void_p(out.data_ptr()),
        ctypes.c_void_p(scale_arg.data_ptr() if scale_arg is not None else 0),
        ctypes.c_void_p(zero_arg.data_ptr() if zero_arg is not None else 0),
        ctypes.c_float(tensor_scale))
    expected = _expected(d, codes, scales, zeros, torch.tensor(tensor_scale, dtype=torch.float32))
    if out.dtype.is_floating_point:
        nan = torch.isnan(expected.float())
        assert torch.equal(torch.isnan(out.float()), nan)
        mismatch = (_bits(out) != _bits(expected)) & ~nan
    else:
        mismatch = out != expected
    assert not bool(mismatch.any()), (
        f"{int(mismatch.sum())} mismatches; first: codes {codes[mismatch.any(1)][0].tolist()}, "
        f"got {out[mismatch.any(1)][0].tolist()}, expected {expected[mismatch.any(1)][0].tolist()}")


def test_lop3_layout_feeds_decoders_in_natural_order(host_library):
    """A packed weight row, decoded word by word, gives the row's values in order (the layout's map)."""
    q = ttype.quantize(torch.randn(1, 256), "int4", group_size=-1)
    d = Decoder("int4", "float32", "none", "float32")
    words = to_lop3(q).qweight[0].contiguous()  # row 0; the layout pads N to 16 rows
    out = torch.empty(words.numel(), 8)
    ones = torch.ones(words.numel())
    getattr(host_library, f"run_{d.name}")(ctypes.c_long(words.numel()), ctypes.c_void_p(words.data_ptr()),
                                           ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(ones.data_ptr()),
                                           None, ctypes.c_float(0))
    assert torch.equal(out.view(-1), q.ttype.decode(q.codes()).view(-1))


def test_decoder_rejects_combinations_it_cannot_compute_exactly():
    with pytest.raises(ValueError, match="layout 'lop3' holds"):
        Decoder("int3", "float16")
    with pytest.raises(ValueError, match="does not convert exactly to int8"):
        Decoder("nf4", "int8", scale=None)
    with pytest.raises(ValueError, match="zero_mode='hqq'"):
        Decoder("uint4", "int8", "hqq", None)
    with pytest.raises(ValueError, match=r"scale='float16' does not fit 'mxfp4'.*accepted: \['uint8'\]"):
        Decoder("mxfp4", "float16", "none", "float16")
    with pytest.raises(ValueError, match="needs an unsigned integer type"):
        Decoder("int4", "float16", "gptq")
    with pytest.raises(ValueError, match="out='int4' is not a decode output"):
        Decoder("int4", "int4")


@pytest.mark.parametrize("decoder", DECODERS, ids=lambda d: d.name)
def test_tir_dequant_is_bit_exact_on_llvm(decoder, build_elementwise):
    """`expr.dequant` (the decode intrinsic's description and the templates' weight formula), built for
    the host CPU, gives the same bits as the reference on the same cases as the C function."""
    from bitkern.codegen.cuda.expr import code, dequant

    d = decoder
    codes, scales, zeros = _cases(d)
    codes, scales = codes[::7], scales[::7]  # every code still appears at every position
    zeros = None if zeros is None else zeros[::7]
    words = _pack_words(codes, d.ttype.bits).view(-1, 1)
    per_word, calls = d.per_word, len(codes)
    specs = [("int32", (calls, 1)), (str(TVM[d.scale]) if d.scale else "float32", (calls,)),
             (TVM[zeros.dtype] if zeros is not None else "uint8", (calls,)), ("float32", (1,))]

    def element(w, s, z, t, i):
        word, lane = i // per_word, i % per_word
        return dequant(d, code(w, word, lane, d.ttype.bits), s[word] if d.scale else None,
                       z[word] if zeros is not None else None, t[0] if d.ttype.tensor_scale and d.scale else None)

    kernel = build_elementwise(element, specs, TVM[TORCH[d.out]])
    out = torch.empty(calls * per_word, dtype=TORCH[d.out])
    scale_arg = scales.contiguous() if d.scale else torch.zeros(calls)
    zero_arg = zeros.contiguous() if zeros is not None else torch.zeros(calls, dtype=torch.uint8)
    tensor_scale = torch.tensor([0.0117], dtype=torch.float32)
    kernel(words, scale_arg, zero_arg, tensor_scale, out)
    expected = _expected(d, codes, scales, zeros, tensor_scale[0]).view(-1)
    if out.dtype.is_floating_point:
        nan = torch.isnan(expected.float())
        if d.out != "bfloat16":  # TVM's LLVM float32 -> bfloat16 rounding turns some NaNs into 0 (CUDA does not)
            assert torch.equal(torch.isnan(out.float()), nan)
        assert torch.equal(_bits(out)[~nan], _bits(expected)[~nan])
    else:
        assert torch.equal(out, expected)
