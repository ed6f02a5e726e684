"""The Matmul as a ttype-annotated tensor expression (TVM TE).

    W[n, k] = (decode_ttype(code[n, k]) - zero[n, g]) · scale[n, g]        (float32, g = k // group)
    Y[m, n] = cast_out( Σ_k acc(X[m, k]) · acc(W[n, k]) + bias[n] )

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
from .matmul import Matmul



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
    bias = te.placeholder((n,), "float32", name="bias") if spec.bias else None
    inputs += [t for t in (tensor_scale, bias) if t is not None]

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
    out_dtype = tvm_dtype(spec.output_dtype)
    output = te.compute((m, n), lambda r, i: _epilogue(accumulated[r, i], bias, i, out_dtype), name="y")
    return MatmulExpr(m, inputs, output)


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


def _epilogue(value, bias, i, out_dtype):
    value = value.astype("float32")
    if bias is not None:
        value = value + bias[i]
    return value.astype(out_dtype)
