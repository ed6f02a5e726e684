"""Generic CPU template: the Matmul tensor expression scheduled for any weight type and any x86 CPU.

It serves what the AMX and AVX512-BF16 templates do not (3-, 5- to 8-bit and 16-bit weights, int8 and fp8
activations, CPUs with neither AMX nor AVX512-BF16).  Schedule: N split into vector-width tiles (parallel), K into blocks; each block's
[lanes x block] weight tile is decoded once into a local buffer and reused for every row of x; the
accumulation is vectorized over N.
"""

from __future__ import annotations

from ...ops.expr import matmul_expr
from ...ops.matmul import Matmul
from .configs import GenericConfig
from .layout import Tile16Storage


def vector_lanes(n: int, wanted: int = 16) -> int:
    """The widest vector width up to `wanted` that divides N (1: no vectorization)."""
    lanes = wanted
    while lanes > 1 and n % lanes:
        lanes //= 2
    return lanes


def build(spec: Matmul, n: int, k: int, config: GenericConfig, layout: str = "rowmajor", name: str = "main"):
    """The scheduled PrimFunc for weights in `layout`; arguments: x, qweight, scales, [zeros],
    [tensor_scale], [bias], y."""
    from tvm import s_tir, te

    storage = Tile16Storage(spec, n, k) if layout == "tile16" else None
    expr = matmul_expr(spec, n, k, storage)
    func = te.create_prim_func([*expr.inputs, expr.output]).with_attr("global_symbol", name)
    sch = s_tir.Schedule(func)
    lanes = vector_lanes(n)
    if spec.activation_dtype == "int8":
        _schedule_int8(sch, lanes)
    else:
        _schedule_float(sch, lanes, _divisor_at_most(k, config.k_block))
    return sch.mod["main"].with_attr("global_symbol", name)


def _divisor_at_most(k: int, wanted: int) -> int:
    return max(d for d in range(1, min(k, wanted) + 1) if k % d == 0)


def _schedule_float(sch, lanes: int, k_block: int) -> None:
    acc = sch.get_sblock("acc")
    rows, cols, red = sch.get_loops(acc)
    col_outer, col_inner = sch.split(cols, [None, lanes])
    red_outer, red_inner = sch.split(red, [None, k_block])
    sch.reorder(col_outer, red_outer, rows, red_inner, col_inner)
    weight = sch.get_sblock("weight")
    sch.transform_layout(weight, ("write", 0), lambda i, j: (j, i))  # the tile k-major: vectors over N
    sch.compute_at(weight, red_outer, preserve_unit_loops=True)
    if lanes > 1:  # decode the tile k-major so it vectorizes over the tile's columns
        w_cols, w_red = sch.get_loops(weight)[-2:]
        sch.reorder(w_red, w_cols)
        sch.vectorize(w_cols)
        sch.vectorize(col_inner)
    sch.parallel(col_outer)
    sch.decompose_reduction(acc, red_outer)
    _schedule_epilogue(sch, lanes)


def _schedule_int8(sch, lanes: int) -> None:
    sums = sch.get_sblock("group_sums")
    rows, cols, groups, red = sch.get_loops(sums)
    col_outer, col_inner = sch.split(cols, [None, lanes])
    sch.reorder(col_outer, groups, rows, red, col_inner)
    if lanes > 1:
        sch.vectorize(col_inner)
    sch.parallel(col_outer)
    sch.decompose_reduction(sums, rows)
    acc = sch.get_sblock("acc")
    a_rows, a_cols, _ = sch.get_loops(acc)
    sch.parallel(a_rows)
    sch.decompose_reduction(acc, a_cols)
    _schedule_epilogue(sch, lanes)


def _schedule_epilogue(sch, lanes: int) -> None:
    out = sch.get_sblock("y")
    rows, cols = sch.get_loops(out)
    sch.parallel(rows)
    if lanes > 1:
        _, inner = sch.split(cols, [None, lanes])
        sch.vectorize(inner)
