"""The CUDA templates' tensor expression (weights in the "lop3" layout, decoded into the mma input type,
padded rows and columns, per-channel scales after the product, bias, output cast), built unscheduled for
the host CPU, against the float64 reference of every weight-type family, activation type and zero mode.
The CUDA templates only reschedule this expression and tensorize parts of it with intrinsics whose
descriptions are this expression (checked by tensorize itself) and whose code is tested bit-exactly.
float8_e4m3 activations are left to the GPU tests: TVM's LLVM float8_e4m3 -> float32 cast turns zero,
subnormals and NaN into wrong values (the CUDA code converts with the hardware's rules)."""

import pytest
import torch

import bitkern
from bitkern import ttype
from tests.helpers import assert_within_epilogue_bound, epilogue_bound
from bitkern.codegen.cuda.expr import cuda_matmul_expr
from bitkern.codegen.cuda.layout import to_lop3
from bitkern.ops import Matmul

TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}
EPS = {"float32": 2.0**-23, "float16": 2.0**-11, "bfloat16": 2.0**-8, "int8": 0.0}
OUTPUT_EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


@pytest.fixture(scope="module")
def run_expr(llvm_target):
    import tvm
    from tvm import te

    def run(spec, q, x, bias=None, row_block=16, residual=None):
        n, k = q.shape
        expr = cuda_matmul_expr(spec, n, k, row_block)
        func = te.create_prim_func([*expr.inputs, expr.output])
        kernel = tvm.compile(tvm.IRModule({"main": func}), target=llvm_target)["main"]
        packed = to_lop3(q)
        y = torch.empty(x.shape[0], spec.out_features(n), dtype=TORCH[spec.output_dtype])
        shape = (x.shape[0], *[int(d) for d in expr.output.shape[1:]])  # SwiGLU's y: [M, N / 16, 16], y's memory
        args = [x, packed.qweight, packed.scales]
        args += [t for t in (packed.zeros, None if packed.tensor_scale is None else packed.tensor_scale.reshape(1),
                             bias, None if residual is None else residual.view(shape)) if t is not None]
        kernel(*args, y.view(shape))
        return y

    return run


def _activations(dtype, m, k, generator):
    x = torch.randn(m, k, generator=generator)
    if dtype == "int8":
        return x.mul(20).round().clamp(-127, 127).to(torch.int8)
    return x.to(TORCH[dtype])


def _check(spec, q, x, bias, y):
    """|y - ref| <= eps_w · Σ|x||w| + K·2^-23 · Σ|x||w| + eps_out·|ref|: the weight's one rounding to the
    mma input type, float32 sums, the output cast."""
    reference = spec.exact(x, q, bias)
    magnitude = x.double().abs() @ q.dequantize(torch.float64).abs().T
    k = q.shape[1]
    bound = (EPS[spec.activation_dtype] + k * 2.0**-23) * magnitude + OUTPUT_EPS[spec.output_dtype] * \
        reference.abs() + 1e-30
    excess = (y.double() - reference).abs() - bound
    assert float(excess.max()) <= 0, f"max excess {float(excess.max()):.3g}"


FLOAT_CASES = [(name, zero) for name in ("int4", "int2", "int1", "int8", "nf4", "fp4_e2m1", "float8_e4m3",
                                         "float8_e5m2") for zero in ("none",)]
FLOAT_CASES += [(name, zero) for name in ("uint4", "uint2", "uint1", "uint8") for zero in ("gptq", "awq", "hqq")]
FLOAT_CASES += [("mxfp4", "none"), ("mxfp8", "none"), ("nvfp4", "none")]


@pytest.mark.parametrize("name, zero_mode", FLOAT_CASES)
@pytest.mark.parametrize("activation", ["float16", "bfloat16", "float32"])
def test_float_activations(name, zero_mode, activation, run_expr):
    t = ttype.get(name)
    generator = torch.Generator().manual_seed(len(name) + len(activation))
    n, k, m = (37, 96, 5) if t.block_size == 1 else (37, 128, 5)
    group = None if t.block_size > 1 else 32
    q = bitkern.quantize(torch.randn(n, k, generator=generator), name, group_size=group, zero_mode=zero_mode,
                         scale_dtype=torch.bfloat16 if activation == "bfloat16" else torch.float16)
    spec = Matmul.for_weight(q, activation, bias=True, output_dtype="float32")
    x = _activations(activation, m, k, generator)
    bias = torch.randn(n, generator=generator)
    _check(spec, q, x, bias, run_expr(spec, q, x, bias))


@pytest.mark.parametrize("name, zero_mode", [("int4", "none"), ("uint4", "gptq"), ("uint2", "awq"), ("int2", "none"),
                                             ("int1", "none"), ("int8", "none")])
def test_int8_activations_per_channel(name, zero_mode, run_expr):
    generator = torch.Generator().manual_seed(7)
    q = bitkern.quantize(torch.randn(48, 128, generator=generator), name, group_size=-1, zero_mode=zero_mode)
    spec = Matmul.for_weight(q, "int8", accumulate_dtype="int32", output_dtype="float32")
    x = _activations("int8", 3, 128, generator)
    _check(spec, q, x, None, run_expr(spec, q, x))


@pytest.mark.parametrize("m, row_block", [(1, 16), (17, 16), (3, 4), (64, 64)])
@pytest.mark.parametrize("output", ["float16", "bfloat16"])
def test_rows_padding_and_output_types(m, row_block, output, run_expr):
    generator = torch.Generator().manual_seed(m)
    q = bitkern.quantize(torch.randn(20, 72, generator=generator), "uint4", group_size=-1, zero_mode="gptq")
    spec = Matmul.for_weight(q, "float16", output_dtype=output)
    x = _activations("float16", m, 72, generator)
    _check(spec, q, x, None, run_expr(spec, q, x, row_block=row_block))


@pytest.mark.parametrize("epilogue, residual", [("relu", True), ("silu", False), ("gelu", True), ("swiglu", False),
                                                ("swiglu", True), ("none", True)])
@pytest.mark.parametrize("name, activation", [("int4", "float16"), ("nf4", "bfloat16"), ("int8", "float16"),
                                              ("int4", "int8")])
def test_epilogues_match_the_unfused_reference(name, activation, epilogue, residual, run_expr):
    """The output stage the templates schedule (`ops.expr.output_stage`, SwiGLU as a gate stage and y over
    [M, N / 16, 16]) against the float64 reference of the unfused computation: the bound of z carried through f."""
    generator = torch.Generator().manual_seed(len(name + activation + epilogue))
    n, k, m = 64, 256, 5
    int8 = activation == "int8"
    q = bitkern.quantize(torch.randn(n, k, generator=generator), name, group_size=-1 if int8 else 64,
                         scale_dtype=torch.bfloat16 if activation == "bfloat16" else torch.float16)
    options = {"accumulate_dtype": "int32", "output_dtype": "float32"} if int8 else {}  # SwiGLU of int8 sums: > fp16
    spec = Matmul.for_weight(q, activation, bias=True, epilogue=epilogue, residual=residual, **options)
    x = _activations(activation, m, k, generator)
    bias = torch.randn(n, generator=generator)
    r = torch.randn(m, spec.out_features(n), generator=generator).to(TORCH[spec.output_dtype]) if residual else None
    y = run_expr(spec, q, x, bias, residual=r)
    plain = Matmul.for_weight(q, activation, bias=True, **options)
    z = plain.exact(x, q, bias)
    magnitude = x.double().abs() @ q.dequantize(torch.float64).abs().T
    bound_z = (EPS[activation] + k * 2.0**-23) * magnitude + 2.0**-23 * z.abs()
    reference = spec.exact(x, q, bias, r)
    assert_within_epilogue_bound(spec, y, reference, epilogue_bound(spec, z, bound_z, reference))
