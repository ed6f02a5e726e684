"""Generic CPU template: the Matmul tensor expression scheduled for any weight type and any CPU (x86-64, aarch64).

It serves what the AMX and AVX512-BF16 templates do not (3-, 5- to 8-bit and 16-bit weights, int8 and fp8
activations, CPUs with neither AMX nor AVX512-BF16).  Schedule: N split into vector-width tiles (parallel), K into blocks; each block's
[lanes x block] weight tile is decoded once into a local buffer and reused for every row of x; the
accumulation is vectorized over N.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...ops.expr import matmul_expr
from ...ops.matmul import EPILOGUES, NORMS, Matmul
from ...ttype import Layout
from ..sched import vector_lanes
from ..template import Work
from .kernel import CpuTemplate, Footprint, doublings, operand_bytes
from .layout import Tile16Storage

# float32 lanes the schedule vectorizes over, at every level: one zmm, two ymm with AVX2 (LLVM splits them; measured on
# Zen 5 at x86-64-v3, int4 4096x4096 M=16: 6.9 ms with 16 lanes, 10.4 ms with the level's own 8)
VECTOR_LANES = 16


@dataclass(frozen=True)
class GenericConfig:
    """Tile configuration of the generic template: `k_block` k's decoded per tile (a divisor of K)."""

    k_block: int = 128


class GenericTemplate(CpuTemplate):
    name = "generic"
    title = "generic"
    config_type = GenericConfig
    layouts = (Layout.TILE16, Layout.ROWMAJOR)
    exact_buffers = False  # TVM's buffer compaction shrinks the tensor expression's buffers
    epilogues = EPILOGUES  # the expression's output stage (`ops.expr.matmul_expr`)
    residual_add = True
    norms = NORMS  # the expression's prologue (`ops.expr.norm_prologue`)

    def unsupported(self, spec: Matmul, n: int, k: int, device) -> None:
        return None

    def resources(self, spec: Matmul, k: int, config: GenericConfig) -> Footprint:
        """Nothing the configuration space bounds (the decoded tile is [lanes x k_block])."""
        return Footprint()

    def configs(self, spec: Matmul, n: int, k: int, bucket: tuple[int, int], device, hint) -> list[GenericConfig]:
        """k blocks from the hint's k up to 256 that divide K, else all of K."""
        return [GenericConfig(block) for block in doublings(hint.k, 256) if k % block == 0] or [GenericConfig(k)]

    def work(self, spec: Matmul, n: int, k: int, m: int, config: GenericConfig, device) -> Work:
        """Per call: every weight decoded once (in vectors of the device's lanes) and M rows of multiply-adds; a
        task per vector of columns."""
        lanes = device.vector_bytes // 4
        operations = {"generic_decode_vector": n * k / lanes, "generic_fma_vector": n * k * m / lanes}
        return Work(max(1, n // lanes), operand_bytes(spec, n, k, m), operations)

    def program(self, spec: Matmul, n: int, k: int, config: GenericConfig, layout, bucket, device):
        """The scheduled PrimFunc for weights in `layout`; arguments: x, qweight, scales, [zeros], [tensor_scale],
        [bias], [residual], y (no constants)."""
        from tvm import s_tir, te

        self.check_config(config)
        storage = Tile16Storage(spec, n, k) if layout == Layout.TILE16 else None
        expr = matmul_expr(spec, n, k, storage)
        func = te.create_prim_func([*expr.inputs, expr.output]).with_attr("global_symbol", "main")
        sch = s_tir.Schedule(func)
        lanes = vector_lanes(VECTOR_LANES, n)
        if spec.activation_dtype == "int8":
            _schedule_int8(sch, lanes)
        else:
            _schedule_float(sch, lanes, _divisor_at_most(k, config.k_block))
        return sch.mod["main"].with_attr("global_symbol", "main"), []


TEMPLATE = GenericTemplate()


def _divisor_at_most(k: int, wanted: int) -> int:
    return max(d for d in range(1, min(k, wanted) + 1) if k % d == 0)


def _schedule_float(sch, lanes: int, k_block: int) -> None:
    acc = sch.get_sblock("acc")
    rows, cols, red = sch.get_loops(acc)
    col_outer, col_inner = sch.split(cols, [None, lanes])
    red_outer, red_inner = sch.split(red, [None, k_block])
    sch.reorder(col_outer, red_outer, rows, red_inner, col_inner)
    # No weight to decode where x is zero for every k (a convolution whose every tap reads the padding: the
    # expression's sums simplify to zero and drop it).
    if any(sch.get(block).name_hint == "weight" for block in sch.get_producers(acc)):
        weight = sch.get_sblock("weight")
        sch.transform_layout(weight, ("write", 0), lambda i, j: (j, i))  # the tile k-major: vectors over N
        sch.compute_at(weight, red_outer, preserve_unit_loops=True)
        if lanes > 1:  # decode the tile k-major so it vectorizes over the tile's columns
            w_cols, w_red = sch.get_loops(weight)[-2:]
            sch.reorder(w_red, w_cols)
            sch.vectorize(w_cols)
    if lanes > 1:
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
