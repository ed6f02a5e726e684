"""The CPU kernel of decode attention (`ops.attention.DecodeAttention`): per row (a KV head of a batch) its group of
query rows against the row's cache, in float32, one call with no temporary tensors.

Per row: the scores s = scale·q·k (masked positions -inf, or the additive mask added) in a scratch row, 16-lane
dot products over the head dimension; their maximum; p = exp(s - max) and its sum, 16 positions at a time (the
scratch row is padded to a multiple of 16 with -inf); out = Σ p·v / Σ p, the head dimension in 16-lane vectors,
skipping positions of weight 0 (masked: an unused cache slot's value is never read).  Rows run in parallel on
torch's threads.

Entry point: `build(spec, device)` -> the compiled function, called as
function(query, key, value, [mask], scale[1], scratch, out) with the shapes of `ops.attention`, scratch
float32 [rows, groups, padded length].
"""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ...ops.attention import DecodeAttention
from .emit.groups import to_output
from .emit.tir import LANES, horizontal_max, horizontal_sum, load, prim_func, ramp, splat, to_float32
from .kernel import compile_function
from .runtime import load_library

# Rows from which the kernel splits them over torch's threads (measured on the Xeon VM, 8 rows of 4 query rows over
# 73 positions of 64 dimensions: 12.4 µs on 2 threads, 22.9 µs on one; waking the second thread costs ~2 µs).
PARALLEL_ROWS = 2


def build(spec: DecodeAttention, device):
    """The compiled decode-attention function of `spec` for the CPU `device`."""
    return load_library(compile_function(_program(spec), device, exact_buffers=True))


def _program(spec: DecodeAttention):
    rows, length, padded, batches = (tirx.Var(name, "int32") for name in ("rows", "length", "padded", "batches"))
    groups, dim = spec.groups, spec.head_dim
    buffers = {}

    def arguments():
        buffers["query"] = T.arg("query", T.Buffer((rows, groups, dim), spec.dtype))
        buffers["key"] = T.arg("key", T.Buffer((rows, length, dim), spec.dtype))
        buffers["value"] = T.arg("value", T.Buffer((rows, length, dim), spec.dtype))
        if spec.mask != "none":
            buffers["mask"] = T.arg("mask", T.Buffer((batches, length), "uint8" if spec.mask == "bool" else "float32"))
        buffers["scale"] = T.arg("scale", T.Buffer((1,), "float32"))
        buffers["scratch"] = T.arg("scratch", T.Buffer((rows, groups, padded), "float32"))
        buffers["out"] = T.arg("out", T.Buffer((rows, groups, dim), spec.dtype))

    def body():
        with T.If(rows >= PARALLEL_ROWS):
            with T.Then():
                with T.parallel(0, rows) as row:
                    _row(spec, buffers, row, length, padded, batches, rows)
            with T.Else():
                with T.serial(0, rows) as row:
                    _row(spec, buffers, row, length, padded, batches, rows)

    return prim_func("main", arguments, body)


def _row(spec: DecodeAttention, b: dict, row, length, padded, batches, rows) -> None:
    """Every query row of `row`'s group against its cache."""
    dim_vectors = spec.head_dim // LANES
    scores = b["scratch"]
    scale = load(b["scale"], 0)
    with T.serial(0, spec.groups) as group:
        with T.serial(0, length) as position:
            product = to_float32(load(b["query"], row, group, ramp(0)), spec.dtype) * \
                to_float32(load(b["key"], row, position, ramp(0)), spec.dtype)
            for c in range(1, dim_vectors):
                product = product + to_float32(load(b["query"], row, group, ramp(c * LANES)), spec.dtype) * \
                    to_float32(load(b["key"], row, position, ramp(c * LANES)), spec.dtype)
            score = horizontal_sum(product) * scale
            T.buffer_store(scores, _masked(spec, b, score, tirx.floordiv(row, tirx.floordiv(rows, batches)), position),
                           [row, group, position])
        with T.serial(length, padded) as position:
            T.buffer_store(scores, tirx.const(float("-inf"), "float32"), [row, group, position])
        _softmax_weights(scores, row, group, padded)
        _weighted_values(spec, b, row, group, length, padded)


def _masked(spec: DecodeAttention, b: dict, score, batch, position):
    """The score with the mask applied: -inf where a bool mask is False, the additive mask added."""
    if spec.mask == "bool":
        return tirx.Select(load(b["mask"], batch, position) != tirx.const(0, "uint8"), score,
                           tirx.const(float("-inf"), "float32"))
    if spec.mask == "additive":
        return score + load(b["mask"], batch, position)
    return score


def _softmax_weights(scores, row, group, padded) -> None:
    """scores[row, group, :] -> exp(score - their maximum), 16 positions a step (the padding's -inf gives 0)."""
    blocks = tirx.floordiv(padded, LANES)
    largest = T.alloc_buffer((LANES,), "float32", align=64)
    T.buffer_store(largest, splat(float("-inf"), "float32"), [ramp(0)])
    with T.serial(0, blocks) as block:
        T.buffer_store(largest, tirx.max(load(largest, ramp(0)), load(scores, row, group, ramp(block * LANES))),
                       [ramp(0)])
    top = horizontal_max(load(largest, ramp(0)))
    with T.serial(0, blocks) as block:
        T.buffer_store(scores, _exp(load(scores, row, group, ramp(block * LANES)) - tirx.Broadcast(top, LANES)),
                       [row, group, ramp(block * LANES)])


def _exp(x):
    """exp of float32 lanes x <= 0 as 2^n·e^r (n = x·log2 e rounded, |r| <= ln2/2, e^r by its Taylor series to r^6:
    relative error ~1e-7); 0 below -87 (and for -inf).  LLVM would call expf once per lane."""
    def const(value):
        return splat(value, "float32")

    clamped = tirx.max(x, const(-87.0))
    n = tirx.floor(clamped * const(1.4426950408889634) + const(0.5))
    r = clamped - n * const(0.6931471805599453)
    series = const(1.0 / 720)
    for coefficient in (1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
        series = series * r + const(coefficient)
    power = tirx.reinterpret(f"float32x{LANES}", tirx.shift_left(tirx.Cast(f"int32x{LANES}", n) + splat(127, "int32"),
                                                                  splat(23, "int32")))
    return tirx.Select(x < const(-87.0), const(0.0), series * power)


def _weighted_values(spec: DecodeAttention, b: dict, row, group, length, padded) -> None:
    """out[row, group, :] = Σ p·v / Σ p over the row's positions (p: the softmax weights in scratch)."""
    dim_vectors = spec.head_dim // LANES
    scores = b["scratch"]
    total = T.alloc_buffer((LANES,), "float32", align=64)
    T.buffer_store(total, splat(0.0, "float32"), [ramp(0)])
    with T.serial(0, tirx.floordiv(padded, LANES)) as block:
        T.buffer_store(total, load(total, ramp(0)) + load(scores, row, group, ramp(block * LANES)), [ramp(0)])
    accumulator = T.alloc_buffer((dim_vectors, LANES), "float32", align=64)
    for c in range(dim_vectors):
        T.buffer_store(accumulator, splat(0.0, "float32"), [c, ramp(0)])
    with T.serial(0, length) as position:
        weight = load(scores, row, group, position)
        with T.If(weight != tirx.const(0.0, "float32")):  # a masked position's value is never read
            with T.Then():
                for c in range(dim_vectors):
                    T.buffer_store(accumulator, load(accumulator, c, ramp(0)) + tirx.Broadcast(weight, LANES) *
                                   to_float32(load(b["value"], row, position, ramp(c * LANES)), spec.dtype),
                                   [c, ramp(0)])
    inverse = tirx.Broadcast(tirx.const(1.0, "float32") / horizontal_sum(load(total, ramp(0))), LANES)
    for c in range(dim_vectors):
        T.buffer_store(b["out"], to_output(load(accumulator, c, ramp(0)) * inverse, spec.dtype),
                       [row, group, ramp(c * LANES)])
