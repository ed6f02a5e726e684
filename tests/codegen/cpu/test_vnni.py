"""Quantized activations (`Matmul.activation_quant="int8"`) and the VNNI template that computes them: the
definition against an independent per-element implementation, the kernel's int8 codes read back bit for bit
through an identity weight, every integer weight type, zero mode, activation type, norm and epilogue against the
float64 reference, non-finite x, the tuner's choice, and the errors for what the operator does not take."""

import dataclasses
import math
import re

import numpy as np
import pytest
import torch

import bitkern
from bitkern.cache import kernel_for
from bitkern.codegen import pack
from bitkern.codegen.cpu import vnni
from bitkern.codegen.cpu.vnni import VnniConfig
from bitkern.ops import Conv2d, ConvGeometry, Matmul
from bitkern.ops.matmul import activation_blocks, quantize_activations
from bitkern.ttype import QuantizedWeight
from bitkern.tuner import host_cpu
from tests.helpers import OUTPUT_EPS, vnni_magnitudes

pytestmark = pytest.mark.requires_avx2
# the levels this CPU runs whose byte products differ: AVX2 and AVX-512 (vpmaddubsw, vpmaddwd), AVX-VNNI and
# AVX512-VNNI (vpdpbusd)
LEVELS = [name for name in ("x86-64-v3", "avx-vnni", "avx512", "avx512-vnni") if host_cpu().at_level(name).runs_here()]


def _q8_reference(row: np.ndarray) -> np.ndarray:
    """x̃ of one row, element by element in numpy float32: blocks of 32 (zero-padded), d = amax / 127, q = the nearest
    integer to v / d (ties to even), clamped to ±127; non-finite values count as 0 and stay as they are."""
    out = np.empty(len(row), dtype=np.float64)
    for start in range(0, len(row), 32):
        block = row[start:start + 32].astype(np.float32)
        finite = np.where(np.isfinite(block), block, np.float32(0))
        d = np.float32(np.max(np.abs(finite)) / np.float32(127))
        for i, (value, kept) in enumerate(zip(block, finite)):
            q = 0.0 if d == 0 else min(127.0, max(-127.0, float(np.round(np.float32(kept / d)))))
            out[start + i] = float(d) * q if np.isfinite(value) else float(value)
    return out


def _ties() -> torch.Tensor:
    """A block whose scale is d = 1/2 (amax 63.5) and whose other ratios v / d lie halfway between integers."""
    return torch.cat([(torch.arange(-15, 16) + 0.5) / 2, torch.tensor([63.5])])


def test_the_definition_matches_an_element_by_element_implementation():
    """Ties (v / d exactly half an integer), all-zero blocks, a block whose scale underflows to zero, non-finite
    values and a tail shorter than a block."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 200, generator=generator)
    x[0, :32] = torch.arange(-16, 16) + 0.5  # amax 15.5: d = 15.5 / 127
    x[1, :32] = _ties()
    x[1, 32:64] = 0
    x[2, :32] = 1e-44  # subnormal: d = 0
    x[3, 5], x[3, 70], x[3, 71] = float("inf"), float("nan"), float("-inf")
    expected = np.stack([_q8_reference(row.numpy()) for row in x])
    got = quantize_activations(x).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(expected))
    assert np.array_equal(np.nan_to_num(got), np.nan_to_num(expected))
    q, d = activation_blocks(x)
    assert q.dtype == torch.int8 and q.shape == (4, 7, 32) and d.shape == (4, 7)
    assert int(q.abs().max()) <= 127


def _identity(k: int) -> QuantizedWeight:
    """A [K, K] 8-bit identity (codes 1, float32 scales 1, per channel): y = x̃ as the kernel quantized it, exactly.
    Its codes are bytes the host's kernel multiplies as they are, with no offset taken off in float afterwards:
    signed where it reads 8-bit codes as signed (AVX2's vpmaddubsw sign trick), unsigned where it reads them as
    unsigned (vpdpbusd, AVX-512's vpmaddubsw)."""
    name = "int8" if vnni.reads_signed_bytes(host_cpu().level, 8) else "uint8"
    codes = torch.eye(k, dtype=torch.int32)
    return QuantizedWeight(name, (k, k), k, "none", bitkern.ttype.pack(codes, 8), torch.ones(k, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_the_kernel_quantizes_x_bit_for_bit_as_the_definition(dtype, m):
    """K = 200 (a partial last block); blocks with ties, zeros and outliers."""
    k = 200
    generator = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=generator) * torch.logspace(-3, 3, m)[:, None]
    x[0, :32] = _ties()
    x[-1, 64:96] = 0
    x = x.to(dtype)
    eye = _identity(k)
    spec = Matmul.for_weight(eye, dtype, output_dtype="float32", activation_quant="int8")
    y = spec(x, pack(eye))
    assert torch.equal(y, quantize_activations(x).float())


def _bound(spec, qweight, x, reference, x_tilde) -> torch.Tensor:
    """The kernel's error bound: 1e-5 of Σ|x̃|·`vnni_magnitudes`, and the output's rounding."""
    return 1e-5 * (x_tilde.abs() @ vnni_magnitudes(qweight).T) + OUTPUT_EPS[spec.output_dtype] * reference.abs() \
        + 1e-30


def _check(spec, qweight, x, y, bias=None, residual=None, norm=()) -> None:
    reference = spec.exact(x, qweight, bias, residual, *norm)
    x_hat = x if spec.norm == "none" else bitkern.ops.matmul.norm_reference(spec.norm, x, *norm, spec.norm_eps)
    excess = (y.double() - reference).abs() - _bound(spec, qweight, x, reference, quantize_activations(x_hat))
    assert float(excess.max()) <= 0, f"max excess {float(excess.max()):.3g}"


@pytest.mark.parametrize("name, zero_mode", [("int8", "none"), ("uint8", "gptq"), ("int4", "none"),
                                             ("uint4", "gptq"), ("uint4", "awq"), ("uint4", "hqq"), ("int2", "none"),
                                             ("uint2", "gptq"), ("int1", "none"), ("uint1", "none")])
@pytest.mark.parametrize("activation, m", [("bfloat16", 1), ("bfloat16", 33), ("float16", 3), ("float32", 17)])
def test_every_integer_weight_type(name, zero_mode, activation, m):
    generator = torch.Generator().manual_seed(m)
    n, k = 48, 256
    qweight = bitkern.quantize(torch.randn(n, k, generator=generator), name, group_size=64, zero_mode=zero_mode)
    spec = Matmul.for_weight(qweight, activation, output_dtype="float32", activation_quant="int8")
    x = torch.randn(m, k, generator=generator).to(getattr(torch, activation))
    _check(spec, qweight, x, spec(x, pack(qweight)))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name, zero_mode", [("int8", "none"), ("uint8", "gptq"), ("int4", "none"), ("uint4", "gptq"),
                                             ("int2", "none"), ("int1", "none")])
@pytest.mark.parametrize("config, m", [(VnniConfig(1, True, 16, 1, 16), 1), (VnniConfig(2, True, 16, 2, 0), 3),
                                       (VnniConfig(1, False, 32, 1, 32), 40)])
def test_every_level_computes_the_same_products(level, name, zero_mode, config, m):
    """The byte dot products of each level (`emit.vnni.dot_bytes`; around the saturating vpmaddubsw AVX2 takes 8-bit
    codes as signed bytes by the sign trick, 512-bit vectors as two nibbles) within the kernels' bound, with codes at
    their extremes (-128 among them)."""
    generator = torch.Generator().manual_seed(m)
    n, k = 40, 256
    qweight = bitkern.quantize(torch.randn(n, k, generator=generator) * 3, name, group_size=64, zero_mode=zero_mode)
    spec = Matmul.for_weight(qweight, "bfloat16", output_dtype="float32", activation_quant="int8")
    bucket = (1, 16) if config.small_m else (17, 256)
    kernel = vnni.TEMPLATE.build(spec, n, k, config, "tile16", bucket, host_cpu().at_level(level))
    x = (torch.randn(m, k, generator=generator) * 100).bfloat16()
    _check(spec, qweight, x, kernel(x, pack(qweight)))


# the 4-bit code books and floats as independent tables of their values: nf4 from QLoRA, e2m1 from the OCP MX spec
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
       0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@pytest.mark.parametrize("name, group, int8_values", [
    ("nf4", 64, [round(v * 127) / 127 for v in NF4]),  # rounded on a grid of 1/127, as llama.cpp's IQ4_NL
    ("fp4_e2m1", 64, E2M1),  # exact: multiples of 1/2
    ("mxfp4", 32, E2M1),
])
@pytest.mark.parametrize("activation, m", [("bfloat16", 1), ("float32", 5), ("bfloat16", 40)])
def test_code_books_multiply_their_int8_values(name, group, int8_values, activation, m):
    """activation_quant="int8" multiplies a 4-bit code book's or float's values on an int8 grid (`TType.int8_values`):
    the definition against the types' published tables, and the kernel (vpshufb of the int8 code book) against it."""
    t, unit = bitkern.ttype.get(name).int8_values
    assert int(t.abs().max()) <= 127 and torch.equal((t.double() * unit).float(), torch.tensor(int8_values))
    generator = torch.Generator().manual_seed(m)
    n, k = 48, 256
    qweight = bitkern.quantize(torch.randn(n, k, generator=generator), name, group_size=group)
    spec = Matmul.for_weight(qweight, activation, output_dtype="float32", activation_quant="int8")
    x = torch.randn(m, k, generator=generator).to(getattr(torch, activation))
    values = torch.tensor(int8_values, dtype=torch.float64)[qweight.codes().long()]
    weight = values * qweight.scale_values().double().repeat_interleave(group, 1)
    assert torch.allclose(spec.exact(x, qweight), quantize_activations(x) @ weight.T, rtol=1e-5, atol=1e-4)
    _check(spec, qweight, x, spec(x, pack(qweight)))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ["nf4", "bnb_fp4", "mxfp4"])
@pytest.mark.parametrize("config, m", [(VnniConfig(1, True, 16, 1, 16), 1), (VnniConfig(2, False, 32, 2, 32), 37)])
def test_every_level_looks_up_the_same_code_book(level, name, config, m):
    """The code book's bytes as each level reads them (`vnni.byte_table`: signed with AVX2's sign trick, unsigned
    with the least bias elsewhere) give the same products within the kernels' bound."""
    generator = torch.Generator().manual_seed(m)
    n, k = 40, 256
    qweight = bitkern.quantize(torch.randn(n, k, generator=generator), name, group_size=32)
    spec = Matmul.for_weight(qweight, "bfloat16", output_dtype="float32", activation_quant="int8")
    bucket = (1, 16) if config.small_m else (17, 256)
    kernel = vnni.TEMPLATE.build(spec, n, k, config, "tile16", bucket, host_cpu().at_level(level))
    x = (torch.randn(m, k, generator=generator) * 100).bfloat16()
    _check(spec, qweight, x, kernel(x, pack(qweight)))


@pytest.mark.parametrize("config, m, bucket", [(VnniConfig(1, True, 16, 1, 0), 1, (1, 16)),
                                               (VnniConfig(6, True, 16, 1, 128), 2, (1, 16)),
                                               (VnniConfig(3, True, 16, 2, 16), 7, (1, 16)),
                                               (VnniConfig(2, False, 32, 4, 32), 70, (17, 256)),
                                               (VnniConfig(3, False, 64, 2, 64), 130, (17, 256)),
                                               (VnniConfig(2, True, 16, 1, 32), 1, (1, 1)),
                                               (VnniConfig(2, True, 16, 4, 32), 3, (2, 4)),
                                               (VnniConfig(3, True, 16, 1, 16, in_turn=True), 1, (1, 1)),
                                               (VnniConfig(2, True, 16, 4, 32, in_turn=True), 3, (2, 4))])
@pytest.mark.parametrize("group", [32, 128, -1])
def test_register_blocks_row_chunks_and_groups(config, m, bucket, group):
    """Tiles that do not divide N (the last block repeats a tile), row counts that do not fill a block or a chunk,
    K not a multiple of 32 where per-channel; buckets of one row block (y in registers over all of K, the task's
    tiles at once or in turn) and of several (groups outside the blocks)."""
    generator = torch.Generator().manual_seed(m)
    n, k = 72, 256 if group != -1 else 232
    qweight = bitkern.quantize(torch.randn(n, k, generator=generator), "int4", group_size=group)
    spec = Matmul.for_weight(qweight, "bfloat16", output_dtype="bfloat16", activation_quant="int8")
    kernel = vnni.TEMPLATE.build(spec, n, k, config, "tile16", bucket, host_cpu())
    x = torch.randn(m, k, generator=generator).bfloat16()
    _check(spec, qweight, x, kernel(x, pack(qweight)))


# x86 levels of 16 vector registers this CPU runs, where blocks of several rows step through a group's words
STEPPED_LEVELS = [level for level in LEVELS if vnni.steps_words(host_cpu().at_level(level).level, 2)]


@pytest.mark.skipif(not STEPPED_LEVELS, reason="needs an x86 level of 256-bit vectors (AVX2) that this CPU runs")
@pytest.mark.parametrize("name, zero_mode", [("int4", "none"), ("uint8", "gptq"), ("int8", "none"), ("int2", "none"),
                                             ("int1", "none"), ("nf4", "none")])
@pytest.mark.parametrize("config, m, bucket", [(VnniConfig(1, False, 32, 4, 32), 37, (17, 256)),
                                               (VnniConfig(2, True, 16, 2, 16), 7, (1, 16)),
                                               (VnniConfig(1, True, 16, 4, 0), 4, (2, 4))])
def test_stepped_blocks_give_the_unrolled_blocks_bit_for_bit(monkeypatch, name, zero_mode, config, m, bucket):
    """Blocks of several rows at AVX2 run a group's products as one loop over its words (`vnni.steps_words`): the
    same int32 sums in the same order as the unrolled blocks, so the same y bit for bit, at every level it applies
    to (row counts that leave a one-row block, which stays unrolled; groups of 64 and per channel)."""
    generator = torch.Generator().manual_seed(m)
    n, k = 40, 256
    for group in (64, -1):
        qweight = bitkern.quantize(torch.randn(n, k, generator=generator), name, group_size=group,
                                   zero_mode=zero_mode)
        spec = Matmul.for_weight(qweight, "bfloat16", output_dtype="float32", activation_quant="int8")
        x = torch.randn(m, k, generator=generator).bfloat16()
        for level in STEPPED_LEVELS:
            device = host_cpu().at_level(level)
            stepped = vnni.TEMPLATE.build(spec, n, k, config, "tile16", bucket, device)(x, pack(qweight))
            with monkeypatch.context() as patch:
                patch.setattr("bitkern.codegen.cpu.emit.vnni.steps_words", lambda level, rows: False)
                unrolled = vnni.TEMPLATE.build(spec, n, k, config, "tile16", bucket, device)(x, pack(qweight))
            assert torch.equal(stepped, unrolled), (name, group, level)
            _check(spec, qweight, x, stepped)


def test_stepped_blocks_keep_the_decoded_codes_in_registers():
    """Compiled for x86-64-v3 (any host): a block of 4 rows and one tile of int4 codes loops over words, each
    iteration one word's 16 vpmaddubsw (2 byte positions x 4 rows x two 256-bit halves) with no vector spilled to
    the stack in any innermost product loop; the unrolled block of 8 products it replaces spilled the decoded codes
    (LLVM scheduled its products row by row); each word's sign flip is one vpxor (a shift gives its second byte
    position), not one per byte position."""
    from bitkern.codegen.cpu.kernel import disassembly

    qweight = bitkern.quantize(torch.randn(64, 512), "int4", group_size=128)
    spec = Matmul.for_weight(qweight, "bfloat16", activation_quant="int8")
    kernel = vnni.TEMPLATE.build(spec, 64, 512, VnniConfig(1, False, 32, 4, 0), "tile16", (17, 256),
                                 host_cpu().at_level("x86-64-v3"))
    loops = [body for body in _backward_loops(disassembly(kernel.library)) if "vpmaddubsw" in body]
    products = [body for body in loops if not any(other != body and other in body for other in loops)]  # innermost
    assert any(body.count("vpmaddubsw") == 16 for body in products), [body.count("vpmaddubsw") for body in products]
    for body in products:
        assert not re.search(r"vmov\w+\s+%ymm\d+,\s*-?\w*\(%rsp\)", body), body
        # int4's sign flip once per word half (the `flip` argument), not once per byte position
        flips = [line for line in body.splitlines() if "vpxor" in line and not re.search(r"(%\w+),\1,\1", line)]
        assert len(flips) <= body.count("vpsrld"), body


def _backward_loops(code: str) -> list[str]:
    """The bodies of the loops in objdump output: from each backward jump's target to the jump, as text."""
    lines = code.splitlines()
    address = {int(match.group(1), 16): i for i, line in enumerate(lines)
               if (match := re.match(r"\s*([0-9a-f]+):", line))}
    loops = []
    for i, line in enumerate(lines):
        match = re.match(r"\s*([0-9a-f]+):\s+j\w+\s+([0-9a-f]+)", line)
        if match and int(match.group(2), 16) < int(match.group(1), 16) and int(match.group(2), 16) in address:
            loops.append("\n".join(lines[address[int(match.group(2), 16)]:i + 1]))
    return loops


@pytest.mark.parametrize("norm, epilogue, residual, m", [("rmsnorm", "swiglu", False, 1),
                                                         ("layernorm", "gelu", True, 9),
                                                         ("torch_rmsnorm", "none", True, 40),
                                                         ("none", "silu", False, 2)])
def test_norm_prologue_and_epilogues(norm, epilogue, residual, m):
    """x̂ is normalized, then quantized; the output stage applies the bias, the epilogue and the residual (SwiGLU:
    within the bound of each of gate and up, through silu(gate)·up, as a small relative error)."""
    generator = torch.Generator().manual_seed(m)
    n, k = 64, 256
    qweight = bitkern.quantize(torch.randn(n, k, generator=generator), "int4", group_size=128)
    spec = Matmul.for_weight(qweight, "bfloat16", bias=True, output_dtype="float32", epilogue=epilogue,
                             residual=residual, norm=norm, norm_eps=1e-5, activation_quant="int8")
    x = (2 * torch.randn(m, k, generator=generator)).bfloat16()
    bias = torch.randn(n, generator=generator)
    out = spec.out_features(n)
    residual_tensor = torch.randn(m, out, generator=generator) if residual else None
    norm_args = () if norm == "none" else (1 + 0.3 * torch.randn(k, generator=generator),
                                           0.2 * torch.randn(k, generator=generator) if norm == "layernorm" else None)
    y = spec(x, pack(qweight), bias, residual_tensor, *norm_args)
    reference = spec.exact(x, qweight, bias, residual_tensor, *norm_args)
    if epilogue in ("none",) and not residual:
        _check(spec, qweight, x, y, bias, residual_tensor, norm_args)
    else:
        assert torch.allclose(y.double(), reference, rtol=1e-4, atol=1e-4 * float(reference.abs().max()))


@pytest.mark.parametrize("level", LEVELS)
def test_swiglu_pairs_computed_in_turn(level):
    """in_turn: a task's gate and up tiles one after the other over all of K, then silu(gate)·up of the pair, as
    computed with both tiles at once (the same int32 sums and float32 steps: equal bitwise), and near the reference."""
    generator = torch.Generator().manual_seed(3)
    n, k = 96, 384
    qweight = bitkern.quantize(torch.randn(n, k, generator=generator), "int4", group_size=128)
    spec = Matmul.for_weight(qweight, "bfloat16", output_dtype="float32", epilogue="swiglu", activation_quant="int8")
    device = host_cpu().at_level(level)
    x = torch.randn(1, k, generator=generator).bfloat16()
    at_once, in_turn = (vnni.TEMPLATE.build(spec, n, k, VnniConfig(4, True, 16, 1, 32, in_turn=turn), "tile16",
                                            (1, 1), device)(x, pack(qweight)) for turn in (False, True))
    assert torch.equal(at_once, in_turn)
    reference = spec.exact(x, qweight)
    assert torch.allclose(in_turn.double(), reference, rtol=1e-4, atol=1e-4 * float(reference.abs().max()))


def test_tiles_in_turn_only_where_one_row_block_serves_every_call():
    """The tuner offers in_turn for buckets a row block holds, with streams of one tile in the cost model; a build
    for a bucket of more rows than the block is refused, naming the field."""
    spec = Matmul("int4", "bfloat16", activation_quant="int8", epilogue="swiglu")
    cpu = host_cpu().at_level("x86-64-v3")
    one = vnni.TEMPLATE.configs(spec, 4096, 4096, (1, 1), cpu, None)
    assert any(c.in_turn and c.n_tiles == 2 for c in one) and all(c.n_tiles % 2 == 0 for c in one)
    assert not any(c.in_turn for c in vnni.TEMPLATE.configs(spec, 4096, 4096, (2, 16), cpu, None))
    config = VnniConfig(4, True, 16, 1, 32, in_turn=True)
    assert vnni.TEMPLATE.work(spec, 4096, 4096, 1, config, cpu).streams == 1
    assert vnni.TEMPLATE.work(spec, 4096, 4096, 1, dataclasses.replace(config, in_turn=False), cpu).streams == 4
    with pytest.raises(ValueError, match="in_turn=True needs one row block"):
        vnni.TEMPLATE.build(spec, 64, 256, config, "tile16", (1, 4), cpu)


def test_nonfinite_activations_give_torch_infinities_and_nans():
    """A row with an Inf keeps ±Inf where torch's x·Wᵀ has it (the finite rest quantized as the definition says),
    a NaN makes its row NaN; other rows are untouched."""
    n, k = 32, 128
    qweight = bitkern.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(1)), "int4", group_size=32)
    spec = Matmul.for_weight(qweight, "float32", output_dtype="float32", activation_quant="int8")
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    x[0, 7] = float("inf")
    x[1, 100] = float("nan")
    y = spec(x, pack(qweight))
    reference = spec.exact(x, qweight)
    assert torch.equal(torch.isnan(y), torch.isnan(reference)) and torch.equal(torch.isinf(y), torch.isinf(reference))
    assert bool(torch.isnan(y[1]).all())
    finite = torch.isfinite(reference)
    assert torch.allclose(y.double()[finite], reference[finite], rtol=1e-5, atol=1e-4)


def test_results_are_bitwise_deterministic():
    qweight = bitkern.quantize(torch.randn(256, 512), "int4", group_size=128)
    spec = Matmul.for_weight(qweight, "bfloat16", activation_quant="int8")
    packed = pack(qweight)
    x = torch.randn(3, 512).bfloat16()
    assert torch.equal(spec(x, packed), spec(x, packed))


def test_the_tuner_runs_quantized_activations_on_the_vnni_template_only():
    qweight = bitkern.quantize(torch.randn(64, 256), "int4", group_size=128)
    for m in (1, 8, 100):
        spec = Matmul.for_weight(qweight, "bfloat16", activation_quant="int8")
        assert kernel_for(spec, 64, 256, m, "tile16").template == "vnni"
        assert kernel_for(dataclasses.replace(spec, activation_quant="none"), 64, 256, m, "tile16").template != "vnni"


def test_a_cpu_without_avx2_has_no_kernel_for_quantized_activations():
    baseline = host_cpu().at_level("x86-64")
    qweight = bitkern.quantize(torch.randn(64, 256), "int4", group_size=128)
    spec = Matmul.for_weight(qweight, "bfloat16", activation_quant="int8")
    assert "avx2" in vnni.TEMPLATE.missing_features(baseline)
    with pytest.raises(ValueError, match="the VNNI template cannot build for the x86-64 level .it needs avx, avx2"):
        vnni.TEMPLATE.build(spec, 64, 256, VnniConfig(), "tile16", (1, 16), baseline)


def test_register_blocks_that_do_not_fit_are_refused_naming_what_is_held():
    """Rows times tiles at once, or rows of one tile when the tiles take turns (n_tiles then is only the width)."""
    with pytest.raises(ValueError, match=r"rows=4 x n_tiles=4 needs more than 30 vector registers"):
        VnniConfig(n_tiles=4, rows=4)
    VnniConfig(n_tiles=4, rows=4, m_chunk=16, in_turn=True)
    with pytest.raises(ValueError, match=r"rows=14, one tile at a time, needs more than 30 vector registers"):
        VnniConfig(n_tiles=2, rows=14, small_m=False, m_chunk=14, in_turn=True)


@pytest.mark.parametrize("fields, message", [
    (dict(weight_dtype="float8_e4m3"), "4-bit code books and floats"),
    (dict(weight_dtype="mxfp8"), "is a 8-bit float type"),
    (dict(activation_dtype="int8", accumulate_dtype="int32"), "quantizes float activations"),
    (dict(activation_quant="int4"), "accepted: \\['none', 'int8'\\]"),
])
def test_specs_the_operator_does_not_take_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        Matmul(**{"weight_dtype": "int4", "activation_dtype": "bfloat16", "activation_quant": "int8", **fields})


def test_groups_must_hold_whole_activation_blocks_and_convolutions_are_refused():
    spec = Matmul("int4", "bfloat16", group_size=16, activation_quant="int8")
    with pytest.raises(ValueError, match="whole activation blocks of 32"):
        spec.check_shape(64, 256)
    Matmul("int4", "bfloat16", group_size=-1, activation_quant="int8").check_shape(64, 200)  # per channel: padded
    with pytest.raises(ValueError, match="convolutions"):
        Conv2d("int4", "bfloat16", geometry=ConvGeometry(32, 8, 8, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1)),
               activation_quant="int8")


def test_the_cost_model_sees_the_prologue_and_the_products():
    """More rows cost more products; a row block decodes the words once for its rows."""
    spec = Matmul("int4", "bfloat16", activation_quant="int8")
    cpu = host_cpu()
    one = vnni.TEMPLATE.work(spec, 4096, 4096, 1, VnniConfig(4, True, 16, 1, 32), cpu)
    four = vnni.TEMPLATE.work(spec, 4096, 4096, 4, VnniConfig(2, True, 16, 4, 32), cpu)
    assert four.bounds[0]["byte_dot"] == 4 * one.bounds[0]["byte_dot"]
    assert four.bounds[0]["vnni_unpack"] == one.bounds[0]["vnni_unpack"]
    assert math.isclose(one.dram_bytes, 4096 * 4096 / 2 + 4096 * 32 * 2 + 4096 * 2 + 4096 * 4)


@pytest.mark.parametrize("name", ["int8", "nf4"])
def test_the_cost_model_shares_magnitudes_and_lookups_across_a_row_block(name):
    """At AVX2 (`vpmaddubsw`), 8-bit codes' vpabsb and a code book's vpshufb run once per word for all of a row
    block's rows: four rows in one block model fewer byte-dot units than in four blocks (at M=256 on the Zen 3,
    int8 4096x4096 rows 4 measured 0.83x the time of one row and two tiles, which the model had ranked first)."""
    spec = Matmul(name, "bfloat16", group_size=128, activation_quant="int8")
    device = host_cpu().at_level("x86-64-v3")
    assert vnni.shared_dot_cost(device.level, 8, name == "nf4") > 0
    single, block = (vnni.TEMPLATE.work(spec, 4096, 4096, 256, VnniConfig(1, False, 128, rows, 0), device)
                     for rows in (1, 4))
    costs = (device.level, 8, name == "nf4")
    saved = 4096 // 16 * 4096 // 32 * vnni.PRODUCTS * (256 - 64) * vnni.shared_dot_cost(*costs)
    assert math.isclose(single.bounds[0]["byte_dot"] - block.bounds[0]["byte_dot"], saved)
    assert vnni.shared_dot_cost(host_cpu().at_level("avx512-vnni").level, 8) == 0


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name, zero_mode", [("int8", "none"), ("uint8", "gptq")])
def test_8_bit_codes_at_their_extremes(level, name, zero_mode):
    """Codes -128 and 127 (int8), 0 and 255 (uint8) against activation codes ±127 in every pair a 16-bit partial sum
    of AVX2's vpmaddubsw would hold: exact (the sign trick's |−128| is 128 as an unsigned byte; 2·128·127 fits)."""
    n, k = 32, 128
    base = bitkern.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(2)), name, group_size=64,
                            zero_mode=zero_mode)
    low, high = (128, 127) if name == "int8" else (0, 255)  # the stored bytes of -128 and 127; of 0 and 255
    pattern = torch.arange(k) % 3 == 0
    codes = torch.where(pattern, low, high).repeat(n, 1).to(torch.uint8)
    codes[::2] = torch.where(pattern, high, low).to(torch.uint8)
    qweight = bitkern.QuantizedWeight(base.ttype, base.shape, base.group_size, base.zero_mode,
                                      bitkern.ttype.packing.pack_codes(codes, 8), base.scales, base.zeros)
    if name == "int8":
        assert {-128, 127} <= set(qweight.dequantize().div(base.scale_values().repeat_interleave(64, 1))
                                  .round().unique().tolist())
    spec = Matmul.for_weight(qweight, "bfloat16", output_dtype="float32", activation_quant="int8")
    kernel = vnni.TEMPLATE.build(spec, n, k, VnniConfig(1, True, 16, 2, 0), "tile16", (1, 16),
                                 host_cpu().at_level(level))
    x = torch.where(torch.arange(k) % 2 == 0, 1.0, -1.0).repeat(3, 1).bfloat16()  # every code ±127
    x[1] = -x[1]
    _check(spec, qweight, x, kernel(x, pack(qweight)))
