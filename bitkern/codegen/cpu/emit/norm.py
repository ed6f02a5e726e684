"""The RMSNorm/LayerNorm prologue the hand-scheduled CPU kernels share (tile16 planes, lookup tables): the norm's
arguments, each row's float32 statistics, and x̂ as `ops.expr.apply_norm` defines it."""

from __future__ import annotations

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ....ops.expr import NORM_ARGUMENTS, apply_norm, norm_rstd
from ....ops.matmul import Matmul
from .tir import LANES, horizontal_sum, lanes, load, ramp, splat


class NormPrologue:
    """A spec's norm prologue inside one kernel: `declare` its [K] float32 arguments (the norm's weight, and bias
    for LayerNorm) where the kernel's argument list has them, `allocate` the per-row statistics in the body,
    `statistics(row, ...)` before the row's x is read, then `apply(row, at, x)` gives x̂."""

    def __init__(self, spec: Matmul, k: int):
        self.spec, self.k = spec, k
        self.vectors = [T.arg(name, T.Buffer((k,), "float32")) for name in NORM_ARGUMENTS[spec.norm]]
        self.stats = None

    @classmethod
    def declare(cls, spec: Matmul, k: int) -> NormPrologue | None:
        """The prologue's arguments, declared now (None for `norm='none'`)."""
        return None if spec.norm == "none" else cls(spec, k)

    def allocate(self, rows) -> None:
        """stats[row] = (mean·rstd, rstd) for `rows` rows (mean·rstd is 0 for the RMS norms)."""
        self.stats = T.alloc_buffer((rows, 2), "float32")

    def statistics(self, row, x_at) -> None:
        """The row's statistics from `x_at(index)`, its x as float32 at a ramp of 16 k's or a scalar k, summed in 16
        lanes as `ops.expr.norm_prologue` defines them: Σx² / K for the RMS norms; the mean, then Σ(x - mean)² / K
        for LayerNorm."""
        k, vectors = self.k, self.k // LANES
        partial = T.alloc_buffer((LANES,), "float32", scope="local", align=64)

        def row_sum(term):
            T.buffer_store(partial, splat(0.0, "float32"), [ramp(0)])
            with T.serial(0, vectors) as v:
                T.buffer_store(partial, load(partial, ramp(0)) + term(x_at(ramp(v * LANES))), [ramp(0)])
            total = horizontal_sum(load(partial, ramp(0)))
            for j in range(vectors * LANES, k):
                total = total + term(x_at(j))
            return total

        stats, eps = self.stats, self.spec.norm_eps
        if self.spec.norm == "layernorm":
            T.buffer_store(stats, row_sum(lambda x: x) / tirx.const(float(k), "float32"), [row, 0])
            mean = load(stats, row, 0)
            T.buffer_store(stats, norm_rstd(row_sum(lambda x: (x - _like(mean, x)) * (x - _like(mean, x))), k, eps),
                           [row, 1])
            T.buffer_store(stats, mean * load(stats, row, 1), [row, 0])
        else:
            T.buffer_store(stats, norm_rstd(row_sum(lambda x: x * x), k, eps), [row, 1])

    def apply(self, row, at, value):
        """x̂ of row `row` from x's float32 `value` (a scalar or lanes), where `at(vector)` loads the norm's [K]
        vectors at value's k's."""
        shift = load(self.stats, row, 0) if self.spec.norm == "layernorm" else None
        weight, *bias = (at(vector) for vector in self.vectors)
        return apply_norm(self.spec.norm, self.spec.activation_dtype, value, shift, load(self.stats, row, 1),
                          weight, *bias)


def _like(scalar, value):
    """A scalar as `value`'s lanes."""
    return scalar if lanes(value) == 1 else tirx.Broadcast(scalar, lanes(value))
