"""Tensor intrinsics the CUDA templates tensorize with: TVM's ldmatrix / mma.sync ones, the few variants
TVM does not register, and the LOP3 decode.

`mma_intrinsics(dtype)` names the group for an mma input type (A row-major, B given as [N, K], float32 or
int32 accumulators, operands in dynamic shared memory).  TVM registers float16 with dynamic shared
memory only; the bfloat16 group is TVM's float16 one with the element type substituted (ldmatrix moves
16-bit words whatever they hold; mma takes "bf16"), and int8 / float8_e4m3 get their dynamic-shared
variants from TVM's own builders.  `decode_intrinsic(decoder)` registers the LOP3 decode of one word:
its description is `expr.dequant` over the word's C codes, its implementation the decoder's C function.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import sys
from dataclasses import dataclass

from .decode import Decoder
from .expr import code, dequant


@dataclass(frozen=True)
class MmaIntrinsics:
    """Names of the registered intrinsics of one mma input type; k_step is the mma's K (16 or 32)."""

    load_a: str
    load_b: str  # from static shared memory (the decoded weight tile)
    compute: str
    init: str
    store: str
    k_step: int


_F16 = MmaIntrinsics("mma_ldmatrix_f16_a_dyn", "mma_ldmatrix_f16_b_trans", "mma_f16f16f32_trans_b",
                     "mma_fill_16x16_f32", "mma_store_16x16_f32_shared_dyn_simple_", 16)
_BF16 = MmaIntrinsics("bitkern_ldmatrix_bf16_a_dyn", "bitkern_ldmatrix_bf16_b_trans",
                      "bitkern_mma_bf16bf16f32_trans_b", "mma_fill_16x16_f32",
                      "mma_store_16x16_f32_shared_dyn_simple_", 16)
_I8 = MmaIntrinsics("bitkern_ldmatrix_i8_a_dyn", "mma_ldmatrix_i8_b_trans", "mma_i8i8i32_trans_b",
                    "mma_fill_16x16_i32", "bitkern_mma_store_16x16_i32_shared_dyn_simple", 32)
_E4M3 = MmaIntrinsics("bitkern_ldmatrix_e4m3_a_dyn", "mma_ldmatrix_e4m3_b_trans", "mma_e4m3e4m3f32_trans_b",
                      "mma_fill_16x16_f32", "mma_store_16x16_f32_shared_dyn_simple_", 32)
_GROUPS = {"float16": _F16, "bfloat16": _BF16, "int8": _I8, "float8_e4m3": _E4M3}
MMA_DTYPES = tuple(_GROUPS)


def mma_k(dtype: str) -> int:
    """K of the mma for inputs of `dtype` (16 for 16-bit types, 32 for 8-bit ones), without loading TVM."""
    if dtype not in _GROUPS:
        raise ValueError(f"no mma for inputs of {dtype}; accepted: {list(MMA_DTYPES)}")
    return _GROUPS[dtype].k_step


def mma_intrinsics(dtype: str) -> MmaIntrinsics:
    """The intrinsic group for mma inputs of `dtype` (registering bitkern's variants on first use)."""
    if dtype not in _GROUPS:
        raise ValueError(f"no mma for inputs of {dtype}; accepted: {list(MMA_DTYPES)}")
    _register_variants()
    return _GROUPS[dtype]


@contextlib.contextmanager
def _cheap_inspect_stack():
    """TVMScript's decorators call `inspect.stack()`, which resolves every frame's source file; with torch
    loaded that scans thousands of modules per frame and importing TVM's intrinsics takes ~30 s instead
    of ~3 s.  TVM only reads the frames and their current line, which this replacement provides."""
    original = inspect.stack

    def stack(context: int = 1):
        frame, frames = sys._getframe(1), []
        while frame is not None:
            code = frame.f_code
            line = linecache.getline(code.co_filename, frame.f_lineno)
            frames.append(inspect.FrameInfo(frame, code.co_filename, frame.f_lineno, code.co_name,
                                            [line] if line else None, 0 if line else None))
            frame = frame.f_back
        return frames

    inspect.stack = stack
    try:
        yield
    finally:
        inspect.stack = original


@functools.lru_cache(maxsize=None)
def _register_variants() -> None:
    with _cheap_inspect_stack():
        _register_with_tvm_builders()


def _register_with_tvm_builders() -> None:
    import tvm.s_tir.tensor_intrin.cuda as cuda
    from tvm.s_tir import TensorIntrin

    for f16_name, bf16_name in ((_F16.load_a, _BF16.load_a), (_F16.load_b, _BF16.load_b),
                                (_F16.compute, _BF16.compute)):
        TensorIntrin.register(bf16_name, *bfloat16_variant(f16_name))
    TensorIntrin.register(_I8.load_a, *cuda.get_ldmatrix_intrin(32, "int8", "A", False, "shared.dyn"))
    TensorIntrin.register(_E4M3.load_a, *cuda.get_ldmatrix_intrin(32, "float8_e4m3fn", "A", False, "shared.dyn"))
    TensorIntrin.register(_I8.store, *cuda.get_mma_store_intrin("int32", 8, "shared.dyn", False))


def bfloat16_variant(f16_name: str):
    """(desc, impl) of a registered float16 intrinsic with bfloat16 elements ("fp16" -> "bf16" in mma)."""
    from tvm.s_tir import TensorIntrin

    intrinsic = TensorIntrin.get(f16_name)
    return retyped(intrinsic.desc, "bfloat16"), retyped(intrinsic.impl, "bfloat16")


def retyped(func, dtype: str):
    """A float16 intrinsic function with its float16 elements in `dtype`, through a TVMScript round trip
    (the printer leaves out ldmatrix's result type, which is written back)."""
    import re

    import tvm

    text = func.script()
    text = re.sub(r"^(\s*T\.ptx_legacy\.ldmatrix\(.*)\)$", r'\1, dtype="float16")', text, flags=re.M)
    abbreviation = {"float16": "fp16", "bfloat16": "bf16"}[dtype]
    text = text.replace('"float16"', f'"{dtype}"').replace('"fp16"', f'"{abbreviation}"')
    return tvm.script.from_source(text)


METADATA_SCOPES = ("global", "local")


def decode_intrinsic(decoder: Decoder, metadata_scope: str = "global") -> str:
    """Register (once) and name the intrinsic decoding one word of `decoder`'s codes into C outputs; the word is in
    registers, the scale and zero in `metadata_scope` (global: read where they are; local: gathered into registers
    first, as the grouped GEMV does for each pair's expert)."""
    if metadata_scope not in METADATA_SCOPES:
        raise ValueError(f"metadata_scope={metadata_scope!r} is not known; accepted: {list(METADATA_SCOPES)}")
    return _registered(decoder, metadata_scope)


@functools.lru_cache(maxsize=None)
def _registered(decoder: Decoder, metadata_scope: str) -> str:
    from tvm.s_tir import TensorIntrin

    name = f"bitkern_{decoder.name}" + ("" if metadata_scope == "global" else f"_{metadata_scope}")
    TensorIntrin.register(name, _decode_function(decoder, True, metadata_scope),
                          _decode_function(decoder, False, metadata_scope))
    return name


def _read_order(decoder: Decoder) -> list[str]:
    """The roles ("word", "scale", ...) in the order TVM infers a block's reads of `dequant`: the
    description must list its reads in the same order as the template's decode block."""
    from tvm import te

    ttype = decoder.ttype
    placeholders = {"word": te.placeholder((1,), "int32", name="word")}
    for role in decoder.arguments():
        placeholders[role] = te.placeholder((1,), "uint8" if decoder.scale == "uint8" and role == "scale"
                                            else "float32", name=role)
    element = (lambda role: placeholders[role][0] if role in placeholders else None)
    out = te.compute((decoder.per_word,), lambda v: dequant(
        decoder, code(_WordView(placeholders["word"]), 0, v, ttype.bits), element("scale"), element("zero"),
        element("tensor_scale")), name="decode")
    func = te.create_prim_func([*placeholders.values(), out])
    return [region.source.name for region in func.body.block.body.body.block.reads]


def _decode_function(decoder: Decoder, describe: bool, metadata_scope: str):
    """The description (loop of `dequant` over the word's codes) or implementation (the C call), the scale and zero
    read from `metadata_scope`."""
    from tvm import ir, sym, tirx
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    from ...ttype import tvm_dtype

    ttype, per_word = decoder.ttype, decoder.per_word
    arguments = decoder.arguments()
    with IRBuilder() as builder:
        with T.prim_func():
            T.func_name("decode_desc" if describe else "decode_impl")
            handles = {role: T.arg(role, T.handle()) for role in ["word", "out", *arguments]}
            word = T.match_buffer(handles["word"], (1,), "int32", scope="local", offset_factor=1)
            out = T.match_buffer(handles["out"], (per_word,), tvm_dtype(decoder.out), scope="local",
                                 offset_factor=1)
            buffers = {}
            for role in arguments:
                if role == "tensor_scale":
                    buffers[role] = T.match_buffer(handles[role], (1,), "float32", offset_factor=1)
                else:
                    dtype = "uint8" if role == "scale" and decoder.scale == "uint8" or \
                        role == "zero" and decoder.zero_mode != "hqq" else tvm_dtype(decoder.scale)
                    buffers[role] = T.match_buffer(handles[role], (1,), dtype, scope=metadata_scope, offset_factor=1)
            element = (lambda role: buffers[role][0] if role in buffers else None)
            if describe:
                everything = {"word": word, **buffers}
                whole = [everything[role][0:1] for role in _read_order(decoder)]
                with T.sblock("decode_word"):
                    T.reads(*whole)
                    T.writes(out[0:per_word])
                    with T.serial(0, per_word) as lane:
                        with T.sblock("decode"):
                            v = T.axis.spatial(per_word, lane)
                            T.reads(*whole)
                            T.writes(out[v])
                            value = dequant(decoder, code(_WordView(word), 0, v, ttype.bits), element("scale"),
                                            element("zero"), element("tensor_scale"))
                            analyzer = sym.Analyzer()
                            analyzer.bind(v, ir.Range(0, per_word))
                            T.buffer_store(out, analyzer.simplify(value), [v])
            else:
                with T.sblock("decode_word"):
                    T.reads(word[0:1], *[b[0:1] for b in buffers.values()])
                    T.writes(out[0:per_word])
                    call_args = [word.access_ptr("r"), out.access_ptr("w")]
                    call_args += [buffers[role][0] for role in arguments]
                    T.evaluate(tirx.call_extern("void", decoder.name, *call_args))
    return builder.get()


class _WordView:
    """Indexes the one-word buffer the way `expr.code` indexes qweight ([row, word])."""

    def __init__(self, word):
        self.word = word

    def __getitem__(self, index):
        return self.word[0]
