"""The Matmul as a ttype-annotated tensor expression (TVM TE).

    W[n, k] = (decode_ttype(code[n, k]) - zero[n, g]) · scale[n, g]        (float32, g = k // group)
    Y[m, n] = cast_out( f(Σ_k acc(X̂[m, k]) · acc(W[n, k]) + bias[n]) (+ residual[m, n]) )

f is the spec's epilogue (`apply_epilogue`; SwiGLU pairs the gate and up rows of a stacked W), in the output
stage the CUDA templates' expression shares (`output_stage`); X̂ is X, or for a spec with a norm prologue X
normalized per row (`apply_norm`, float32 statistics `norm_prologue`).

The decode is the weight type's own TVM builder (`TType.tvm_decode`).  X is the [M, K] input, or for a
`Conv2d` spec the implicit-GEMM gather from the NHWC image (zero outside it, see `bitkern.ops.conv`).
Where the codes, scales and zeros live is a *weight storage*: `PortableStorage` reads the portable layout
(`bitkern.ttype.pack`); code generators pass their own layouts.  int8 activations accumulate exact int32
sums per group and scale them in float32.  The expression's arguments, in order, are `MatmulExpr.inputs`
then the output.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ttype import effective_group_size, get, packed_length, tvm_dtype, tvm_unpack
from .matmul import SWIGLU_BLOCK, Matmul



class PortableStorage:
    """qweight [N, words] packed along K, scales/zeros [N, groups]: the layout of QuantizedWeight."""

    def __init__(self, spec: Matmul, n: int, k: int):
        from tvm import te

        ttype = get(spec.weight_dtype)
        self.bits = ttype.bits
        group = effective_group_size(spec.group_size, k)
        groups = k // group
        self.qweight = te.placeholder((n, packed_length(k, self.bits)), "int32", name="qweight")
        self.scales = te.placeholder((n, groups), scale_storage(spec), name="scales")
        self.zeros = te.placeholder((n, groups), zero_storage(spec), name="zeros") \
            if spec.zero_mode != "none" else None

    def code(self, i, j):
        return tvm_unpack(self.qweight, (i, j), self.bits)

    def scale(self, i, g):
        return self.scales[i, g]

    def zero(self, i, g):
        return self.zeros[i, g]


def scale_storage(spec: Matmul) -> str:
    """TVM dtype the scales are stored in: uint8 codes of the block scale type, or the scale dtype."""
    return "uint8" if get(spec.weight_dtype).block_size > 1 else tvm_dtype(spec.scale_dtype)


def zero_storage(spec: Matmul) -> str:
    return tvm_dtype(spec.scale_dtype) if spec.zero_mode == "hqq" else "uint8"


@dataclass
class MatmulExpr:
    """The TE tensors of one Matmul: `inputs` (in argument order) and `output`; `m` is the symbolic M."""

    m: object
    inputs: list
    output: object


def matmul_expr(spec: Matmul, n: int, k: int, storage=None) -> MatmulExpr:
    """Build the expression for a [N, K] weight (in `storage`, default portable) and symbolic M rows."""
    from tvm import te

    ttype = get(spec.weight_dtype)
    storage = storage or PortableStorage(spec, n, k)
    group = effective_group_size(spec.group_size, k)
    groups = k // group

    m, x, x_at = activation(spec, k)
    inputs = [x, storage.qweight, storage.scales] + ([storage.zeros] if storage.zeros is not None else [])
    tensor_scale = te.placeholder((1,), "float32", name="tensor_scale") if ttype.tensor_scale else None
    inputs += [tensor_scale] if tensor_scale is not None else []
    if spec.norm != "none":
        norm_vectors = [te.placeholder((k,), "float32", name=name) for name in NORM_ARGUMENTS[spec.norm]]
        inputs += norm_vectors
        x_at = norm_prologue(spec, m, k, x_at, *norm_vectors)
    bias = te.placeholder((n,), "float32", name="bias") if spec.bias else None
    inputs += [bias] if bias is not None else []

    def scale_of(i, g):
        if ttype.block_size == 1:
            return storage.scale(i, g).astype("float32")
        value = get(ttype.block_scale).tvm_decode(storage.scale(i, g), "float32")
        return value * tensor_scale[0] if tensor_scale is not None else value

    def value_of(i, j, dtype):
        code = storage.code(i, j)
        if spec.zero_mode != "none":
            return code.astype(dtype) - storage.zero(i, j // group).astype(dtype)
        if dtype == "int32":  # int8 activations: the spec admits only types exact in int8
            return ttype.tvm_decode(code, "int8").astype("int32")
        return ttype.tvm_decode(code, dtype)

    if spec.activation_dtype == "int8":
        reduce_k = te.reduce_axis((0, group), name="k")
        partial = te.compute(
            (m, n, groups),
            lambda r, i, g: te.sum(x_at(r, g * group + reduce_k).astype("int32")
                                   * value_of(i, g * group + reduce_k, "int32"), axis=reduce_k),
            name="group_sums")
        reduce_g = te.reduce_axis((0, groups), name="g")
        accumulated = te.compute((m, n), lambda r, i: te.sum(partial[r, i, reduce_g].astype("float32")
                                                             * scale_of(i, reduce_g), axis=reduce_g), name="acc")
    else:
        acc = tvm_dtype(spec.accumulate_dtype)
        weight = te.compute((n, k), lambda i, j: (value_of(i, j, "float32") * scale_of(i, j // group)).astype(acc),
                            name="weight")
        reduce_all = te.reduce_axis((0, k), name="k")
        accumulated = te.compute((m, n), lambda r, i: te.sum(x_at(r, reduce_all).astype(acc) * weight[i, reduce_all],
                                                             axis=reduce_all), name="acc")

    def z(r, i):  # x·Wᵀ + b in float32
        value = accumulated[r, i].astype("float32")
        return value + bias[i] if bias is not None else value

    return MatmulExpr(m, inputs, output_stage(spec, m, n, z, inputs))


def output_stage(spec: Matmul, m, n: int, z, inputs: list, tiled: bool = False):
    """y [M, out_features] = cast_out(f(z) (+ residual)) for the float32 sums z(r, i) (bias added) of N weight
    rows, f the spec's epilogue (SwiGLU: silu of gate row 32·(j // 16) + j % 16 times the up row 16 below it,
    `swiglu_rows`); appends the residual placeholder (residual specs) to `inputs`.  The CPU expression and the
    CUDA templates' (`codegen.cuda.expr`) share it.  tiled (SwiGLU): y and the residual as [M, out_features / 16,
    16], the same memory, so that y's reads of z are affine in y's own indices (the CUDA GEMM places y where a
    block of z is computed)."""
    from tvm import te, tirx

    out_dtype = tvm_dtype(spec.output_dtype)
    out_n = spec.out_features(n)
    swiglu = spec.epilogue == "swiglu"
    shape = (m, out_n // SWIGLU_BLOCK, SWIGLU_BLOCK) if swiglu and tiled else (m, out_n)
    residual = te.placeholder(shape, out_dtype, name="residual") if spec.residual else None
    inputs += [residual] if residual is not None else []

    def y(r, *j):
        if swiglu:
            block, lane = j if len(j) == 2 else (tirx.floordiv(j[0], SWIGLU_BLOCK), tirx.floormod(j[0], SWIGLU_BLOCK))
            gate = block * 2 * SWIGLU_BLOCK + lane
            value = apply_epilogue("silu", z(r, gate)) * z(r, gate + SWIGLU_BLOCK)
        else:
            value = apply_epilogue(spec.epilogue, z(r, *j))
        return output_value(spec, value, None if residual is None else residual[(r, *j)])

    return te.compute(shape, y, name="y")


def output_value(spec: Matmul, value, residual=None):
    """The end of every output stage, after the epilogue: the residual (in the output type; None: no residual)
    added in float32 to `value`, then the cast to the spec's output type."""
    value = value + residual.astype("float32") if residual is not None else value
    return value.astype(tvm_dtype(spec.output_dtype))


_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def apply_epilogue(epilogue: str, value):
    """f(value) of an elementwise epilogue ("none", "relu", "silu", "gelu") on a float32 TIR expression, scalar
    or vector: the one definition the templates' output stages emit (SwiGLU is silu of the gate times the up)."""
    from tvm import tirx

    count = value.ty.dtype.lanes

    def const(number: float):
        scalar = tirx.const(number, "float32")
        return scalar if count == 1 else tirx.Broadcast(scalar, count)

    if epilogue == "none":
        return value
    if epilogue == "relu":
        return tirx.max(value, const(0.0))
    if epilogue == "silu":
        return value / (const(1.0) + tirx.exp(const(0.0) - value))
    if epilogue == "gelu":  # 0.5·v·(1 + erf(v/√2)), erf by Abramowitz & Stegun 7.1.26 (|error| < 1.5e-7): LLVM
        # has no vector erf, and the polynomial needs one exp
        u = tirx.abs(value) * const(0.5 ** 0.5)
        t = const(1.0) / (const(1.0) + const(_ERF_P) * u)
        poly = const(0.0)
        for coefficient in reversed(_ERF_A):
            poly = (poly + const(coefficient)) * t
        erf = const(1.0) - poly * tirx.exp(const(0.0) - u * u)
        return const(0.5) * value + const(0.5) * tirx.abs(value) * erf
    raise ValueError(f"epilogue={epilogue!r} is not elementwise; accepted: 'none', 'relu', 'silu', 'gelu'")


NORM_ARGUMENTS = {"rmsnorm": ("norm_weight",), "torch_rmsnorm": ("norm_weight",),
                  "layernorm": ("norm_weight", "norm_bias")}  # the kernel arguments of each norm prologue, float32 [K]


def norm_prologue(spec: Matmul, m, k: int, x_at, weight, bias=None):
    """x̂_at(row, j): X normalized per row as `Matmul.norm`, from float32 row statistics (Σx² / K for the RMS
    norms; the mean, then Σ(x - mean)² / K for LayerNorm) in TE stages of their own."""
    from tvm import te

    def x_float(r, j):
        return x_at(r, j).astype("float32")

    if spec.norm == "layernorm":
        j1 = te.reduce_axis((0, k), name="norm_k")
        total = te.compute((m,), lambda r: te.sum(x_float(r, j1), axis=j1), name="norm_sum")
        j2 = te.reduce_axis((0, k), name="norm_k2")

        def centred(r, j):
            return x_float(r, j) - total[r] / float(k)

        squares = te.compute((m,), lambda r: te.sum(centred(r, j2) * centred(r, j2), axis=j2), name="norm_squares")
    else:
        total = None
        j1 = te.reduce_axis((0, k), name="norm_k")
        squares = te.compute((m,), lambda r: te.sum(x_float(r, j1) * x_float(r, j1), axis=j1), name="norm_squares")
    rstd = te.compute((m,), lambda r: norm_rstd(squares[r], k, spec.norm_eps), name="norm_rstd")

    def normalized(r, j):
        shift = total[r] / float(k) * rstd[r] if total is not None else None
        return apply_norm(spec.norm, spec.activation_dtype, x_float(r, j), shift, rstd[r], weight[j],
                          bias[j] if bias is not None else None)

    x_hat = te.compute((m, k), normalized, name="x_norm")
    return lambda r, j: x_hat[r, j]


def norm_rstd(squares, k: int, eps: float):
    """1 / sqrt(Σ squares / K + eps) in float32, as torch.rsqrt of the mean (a scalar TIR expression)."""
    from tvm import tirx

    one = tirx.const(1.0, "float32")
    return one / tirx.sqrt(squares / tirx.const(float(k), "float32") + tirx.const(eps, "float32"))


def apply_norm(norm: str, dtype: str, value, shift, rstd, weight, bias=None):
    """x̂ of float32 x (TIR, scalar or vector) given its row's rstd and shift = mean·rstd (LayerNorm; None for
    the RMS norms) and the norm weight (and bias) at x's k's, rounded to the activation `dtype` where
    `bitkern.ops.matmul.norm_reference` rounds: the one definition the templates' prologues emit."""
    from tvm import tirx

    count = value.ty.dtype.lanes

    def lanes(scalar):
        return scalar if count == 1 or scalar.ty.dtype.lanes == count else tirx.Broadcast(scalar, count)

    scaled = value * lanes(rstd)
    if norm == "layernorm":
        return round_to((scaled - lanes(shift)) * weight + bias, dtype)
    if norm == "rmsnorm":
        return round_to(weight * round_to(scaled, dtype), dtype)
    if norm == "torch_rmsnorm":
        return round_to(scaled * weight, dtype)
    raise ValueError(f"norm={norm!r} is not a norm prologue; accepted: {list(NORM_ARGUMENTS)}")


def round_to(value, dtype: str):
    """float32 TIR values rounded to `dtype` (float32, float16, or bfloat16 to nearest even) and back."""
    from tvm import tirx

    count = value.ty.dtype.lanes
    typed = (lambda name: f"{name}x{count}") if count > 1 else (lambda name: name)
    if dtype == "float32":
        return value
    if dtype == "float16":
        return tirx.Cast(typed("float32"), tirx.Cast(typed("float16"), value))
    if dtype != "bfloat16":
        raise ValueError(f"dtype={dtype!r}: a norm rounds to float32, float16 or bfloat16")

    def const(number: int):
        scalar = tirx.const(number, "uint32")
        return scalar if count == 1 else tirx.Broadcast(scalar, count)

    bits = tirx.reinterpret(typed("uint32"), value)
    lsb = tirx.bitwise_and(tirx.shift_right(bits, const(16)), const(1))
    rounded = tirx.bitwise_and(bits + const(0x7FFF) + lsb, const(0xFFFF0000))
    return tirx.reinterpret(typed("float32"), rounded)


def activation(spec: Matmul, k: int):
    """(M, the x placeholder, x_at(row, k) -> X[row, k]): x itself [M, K], or for a convolution the NHWC
    image [B, H, W, Cin] with M = B·Hout·Wout and X[row, (kh, kw, c)] the pixel the tap reads (0 outside)."""
    from tvm import te, tirx

    dtype = tvm_dtype(spec.activation_dtype)
    g = spec.geometry
    if g is None:
        m = te.var("M")
        x = te.placeholder((m, k), dtype, name="x")
        return m, x, lambda r, j: x[r, j]
    batch = te.var("B")
    x = te.placeholder((batch, g.height, g.width, g.in_channels), dtype, name="x")

    def x_at(r, j):
        where, inside = tap_source(g, r, tirx.floordiv(j, g.in_channels))
        return tirx.if_then_else(inside, x[(*where, tirx.floormod(j, g.in_channels))], tirx.const(0, dtype))

    return batch * g.pixels, x, x_at


def tap_source(g, row, tap):
    """((image, ih, iw), inside): the pixel of the NHWC input that output row `row` (image, oh, ow) reads
    for kernel tap `tap` (kh · kernel width + kw), and whether it lies inside the image (zero padding otherwise)."""
    from tvm import tirx

    pixel = tirx.floormod(row, g.pixels)
    ih = tirx.floordiv(pixel, g.out_size[1]) * g.stride[0] - g.padding[0] + \
        tirx.floordiv(tap, g.kernel[1]) * g.dilation[0]
    iw = tirx.floormod(pixel, g.out_size[1]) * g.stride[1] - g.padding[2] + \
        tirx.floormod(tap, g.kernel[1]) * g.dilation[1]
    return (tirx.floordiv(row, g.pixels), ih, iw), tirx.all(ih >= 0, ih < g.height, iw >= 0, iw < g.width)
