"""The Matmul as the tensor expression the CUDA templates schedule, over the "lop3" weight layout.

    W[n, k] = round_c((v(code[n, k]) - z[n, g]) · s[n, g])     (float compute types c; g = k // group)
    W[n, k] = v(code[n, k]) [- z[n, g]]                        (int8 / float8_e4m3: scaled after the sum)
    Z[m, n] = Σ_k acc(X[m, k]) · acc(W[n, k]) [· s[n]] + bias[n]
    Y[m, j] = cast_out( f(Z[m, j]) [+ residual[m, j]] )     (SwiGLU: silu(Z[m, gate j]) · Z[m, up j])

Unlike `bitkern.ops.expr.matmul_expr` (weights in the float32 accumulation type), W here is in the type
the tensor cores multiply, which is what mma needs.  `dequant` is the single definition of W: the
expression and the description of the LOP3 decode intrinsic (`intrin.decode_intrinsic`) both call it,
so tensorize matches them structurally, and the decode functions are tested against the same formula.
f is the spec's epilogue, from the one definition the CPU kernels emit too (`ops.expr.apply_epilogue`).
Arguments, in order: x, qweight, scales, zeros (zero modes), tensor_scale (NVFP4), bias (bias specs),
residual (residual specs), then y (the CPU kernels' order).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ops.expr import output_stage, scale_storage, zero_storage
from ...ops.matmul import Matmul
from ...ttype import codes_per_word, effective_group_size, get, tvm_dtype
from .decode import FLOAT_OUTPUTS, Decoder
from .layout import layout_group, padded_shape

MAX_ROWS = 1 << 30  # rows a kernel serves; bounds M so padded row counts stay within int32
ACCUMULATE = {"float16": "float32", "bfloat16": "float32", "float32": "float32", "int8": "int32",
              "float8_e4m3": "float32"}


def decoder_for(spec: Matmul) -> Decoder:
    """The decode function a spec's weights need: outputs in the activation type."""
    ttype = get(spec.weight_dtype)
    out = spec.activation_dtype
    if out not in FLOAT_OUTPUTS:
        scale = None
    else:
        scale = "uint8" if ttype.block_size > 1 else spec.scale_dtype
    return Decoder(ttype.name, out, spec.zero_mode, scale)


def code(qweight, n, k, bits: int):
    """uint32 code of element (n, k) in the lop3 layout (see `layout.py` for the word map)."""
    from tvm import tirx

    per_word = codes_per_word(bits)
    within = k % per_word
    position = within // 2 + (within % 2) * (per_word // 2)
    word = qweight[n, k // per_word].astype("uint32")
    return tirx.bitwise_and(tirx.shift_right(word, (position * bits).astype("uint32")),
                            tirx.const((1 << bits) - 1, "uint32"))


def dequant(decoder: Decoder, code_value, scale=None, zero=None, tensor_scale=None):
    """The weight value (in the decoder's output type) of a code with its group's scale and zero.

    Codebook values come from the type's select tree (`TType.tvm_decode` without a table): a table load
    indexed by data cannot be matched by tensorize, whose description the decode intrinsic needs."""
    return _nan_free(_dequant(decoder, code_value, scale, zero, tensor_scale))


def _dequant(decoder: Decoder, code_value, scale, zero, tensor_scale):
    ttype, out = decoder.ttype, decoder.out
    if out == "int8":
        if zero is not None:
            return (code_value.astype("int32") - zero.astype("int32")).astype("int8")
        return ttype.tvm_decode(code_value, "int8")
    if out == "float8_e4m3":
        return ttype.tvm_decode(code_value, "float8_e4m3")
    if zero is not None:
        value = code_value.astype("float32") - zero.astype("float32")
    else:
        value = ttype.tvm_decode(code_value, "float32")
    if ttype.block_size > 1:
        factor = get(ttype.block_scale).tvm_decode(scale, "float32")
        if tensor_scale is not None:
            factor = factor * tensor_scale
    else:
        factor = scale.astype("float32")
    weight = value * factor
    return weight if out == "float32" else weight.astype(tvm_dtype(out))


def _nan_free(expr):
    """`expr` with NaN constants written as bit patterns (reinterpret of an integer): TVM's structural
    comparison finds NaN != NaN, so a tensorize description holding a NaN literal never matches."""
    import tvm
    from tvm import tirx

    if isinstance(expr, tirx.FloatImm):
        if expr.value == expr.value:
            return expr
        bits = tvm.DataType(str(expr.ty.dtype)).bits
        nan = {16: 0x7E00, 32: 0x7FC00000, 64: 0x7FF8000000000000}[bits]
        return tirx.reinterpret(expr.ty, tirx.const(nan, f"uint{bits}"))
    if isinstance(expr, tirx.Select):
        return tirx.Select(_nan_free(expr.condition), _nan_free(expr.true_value), _nan_free(expr.false_value))
    if isinstance(expr, tirx.Cast):
        return tirx.Cast(expr.ty, _nan_free(expr.value))
    if isinstance(expr, tvm.ir.Call) and isinstance(expr.op, tvm.ir.Op):
        return tvm.ir.Call(expr.op, [_nan_free(a) for a in expr.args], expr.attrs, expr.ty_args, ret_ty=expr.ty)
    if isinstance(expr, (tirx.Not, tirx.BitwiseNot)):
        return type(expr)(_nan_free(expr.a))
    if isinstance(expr, tvm.ir.expr.Expr) and hasattr(expr, "a") and hasattr(expr, "b"):
        return type(expr)(_nan_free(expr.a), _nan_free(expr.b))
    return expr  # constants, variables and loads (whose integer indices hold no NaN)


@dataclass
class CudaExpr:
    """The TE tensors of one CUDA Matmul: `inputs` (argument order), the decoded weight `wdec`, the
    product `acc`, the `output`; `m` is the symbolic number of rows."""

    m: object
    inputs: list
    wdec: object
    acc: object
    output: object
    decoder: Decoder


def cuda_matmul_expr(spec: Matmul, n: int, k: int, row_block: int) -> CudaExpr:
    """The expression for a [N, K] weight in the lop3 layout and symbolic M rows.

    The product is computed for M rounded up to `row_block` rows; the rows past M read row M - 1 (so no
    load needs a predicate) and are never stored.  Columns of x past K read as zero.  M is at most
    MAX_ROWS (the kernels check it)."""
    from tvm import te, tirx

    ttype = get(spec.weight_dtype)
    decoder = decoder_for(spec)
    n_pad, k_pad = padded_shape(n, k)
    group = layout_group(effective_group_size(spec.group_size, k), k)
    columns = -(-k_pad // group)
    m = te.var("M")
    x = te.placeholder((m, k), tvm_dtype(spec.activation_dtype), name="x")
    qweight = te.placeholder((n_pad, k_pad // codes_per_word(ttype.bits)), "int32", name="qweight")
    scales = te.placeholder((n_pad, columns), scale_storage(spec), name="scales")
    inputs = [x, qweight, scales]
    zeros = tensor_scale = bias = None
    if spec.zero_mode != "none":
        zeros = te.placeholder((n_pad, columns), zero_storage(spec), name="zeros")
        inputs.append(zeros)
    if ttype.tensor_scale:
        tensor_scale = te.placeholder((1,), "float32", name="tensor_scale")
        inputs.append(tensor_scale)
    if spec.bias:
        bias = te.placeholder((n,), "float32", name="bias")
        inputs.append(bias)
    scaled_later = decoder.scale is None

    def weight(i, j):
        g = j // group
        return dequant(decoder, code(qweight, i, j, ttype.bits),
                       None if scaled_later else scales[i, g], None if zeros is None else zeros[i, g],
                       None if tensor_scale is None else tensor_scale[0])

    wdec = te.compute((n_pad, k_pad), weight, name="wdec")
    m_pad = (tirx.min(m, MAX_ROWS) + (row_block - 1)) // row_block * row_block
    last = m - 1

    def padded_x(r, j):
        value = x[tirx.min(r, last) if row_block > 1 else r, j]
        if k_pad > k:
            value = tirx.if_then_else(j < k, value, tirx.const(0, x.dtype))
        return value

    xk = te.compute((m_pad, k_pad), padded_x, name="xk")
    acc_dtype = ACCUMULATE[spec.activation_dtype]
    reduce_k = te.reduce_axis((0, k_pad), name="k")
    acc = te.compute((m_pad, n_pad), lambda r, i: te.sum(
        xk[r, reduce_k].astype(acc_dtype) * wdec[i, reduce_k].astype(acc_dtype), axis=reduce_k), name="acc")

    def z(r, i):
        value = acc[r, i].astype("float32")
        if scaled_later:
            value = value * scales[i, 0].astype("float32")
        return value + bias[i] if bias is not None else value

    return CudaExpr(m, inputs, wdec, acc, output_stage(spec, m, n, z, inputs, tiled=True), decoder)
