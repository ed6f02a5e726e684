"""The per-group weight metadata the tile16 templates read (scales, zeros, tensor scale) as kernel
arguments, decoded to float32 lanes, and the last steps of their output stages: the bias, the residual add and
the cast of float32 results to the output type."""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.script.ir_builder import tirx as T

from ....ops.matmul import Matmul
from ....ttype import get
from .tir import LANES, bf16_bits, bf16_to_float, lanes, load, prefetch, prefetch_ahead, ramp

PREFETCH_GROUPS = 4  # a few groups of a task's work: well past the memory latency, two lines of fp16 scales


@dataclass
class GroupArguments:
    """The scales, zeros (zero modes) and tensor_scale (nvfp4) buffers, laid out per_tile = (tiles,
    groups, 16): one 16-lane vector per tile and group."""

    spec: Matmul
    scales: object
    zeros: object
    tensor_scale: object

    @classmethod
    def declare(cls, spec: Matmul, per_tile: tuple) -> "GroupArguments":
        """Declare the arguments, in this order, in the PrimFunc being built."""
        ttype = get(spec.weight_dtype)
        scales = T.arg("scales", T.Buffer(per_tile, "uint8" if ttype.block_size > 1 else spec.scale_dtype))
        zeros = None
        if spec.zero_mode != "none":
            zeros = T.arg("zeros", T.Buffer(per_tile, spec.scale_dtype if spec.zero_mode == "hqq"
                                            else "uint8"))
        tensor_scale = T.arg("tensor_scale", T.Buffer((1,), "float32")) if ttype.tensor_scale else None
        return cls(spec, scales, zeros, tensor_scale)

    def scale(self, tile_index, group):
        """The group's 16 scales as float32 (block scales decoded, times the tensor scale)."""
        raw = load(self.scales, tile_index, group, ramp(0))
        ttype = get(self.spec.weight_dtype)
        if ttype.block_size == 1:
            return self._float_lanes(raw)
        scale = get(ttype.block_scale).tvm_decode(tirx.Cast("uint32x16", raw), "float32")
        if self.tensor_scale is not None:
            scale = scale * tirx.Broadcast(load(self.tensor_scale, 0), LANES)
        return scale

    def prefetch(self, tile_index, group, tiles_per_task: int) -> None:
        """Prefetch the scales (and zeros) PREFETCH_GROUPS groups past (tile, group): left to demand misses,
        these small reads stall the weight stream once per group (measured: a third of an int1 GEMV's time
        from DRAM)."""
        for buffer in (self.scales, self.zeros):
            if buffer is not None:
                prefetch_ahead(buffer, tile_index, group, PREFETCH_GROUPS, tiles_per_task)

    def prefetch_into_l2(self, tile_index, group) -> None:
        """Prefetch the group's scales (and zeros) of one tile into L2 (for a later task)."""
        for buffer in (self.scales, self.zeros):
            if buffer is not None:
                prefetch(load(buffer, tile_index, group, 0), into_l1=False)

    def zero(self, tile_index, group):
        """The group's 16 zero points as float32 (integers, or hqq's stored floats)."""
        raw = load(self.zeros, tile_index, group, ramp(0))
        return tirx.Cast("float32x16", raw) if self.spec.zero_mode != "hqq" else self._float_lanes(raw)

    def _float_lanes(self, raw):
        return bf16_to_float(raw) if self.spec.scale_dtype == "bfloat16" else tirx.Cast("float32x16", raw)


def to_output(value, output_dtype: str):
    """float32 lanes (or a scalar) as `output_dtype`; bfloat16 rounds to nearest even by integer arithmetic."""
    suffix = f"x{lanes(value)}" if lanes(value) > 1 else ""
    if output_dtype == "bfloat16":
        return tirx.reinterpret(f"bfloat16{suffix}", tirx.Cast(f"uint16{suffix}", bf16_bits(value)))
    return tirx.Cast(f"{output_dtype}{suffix}", value)


def biased(value, bias, columns):
    """value + bias[columns] (float32), or value for kernels without a bias."""
    return value + load(bias, columns) if bias is not None else value


def write_output(spec: Matmul, y, residual, value, row, columns) -> None:
    """y[row, columns] = value (+ residual[row, columns]) in the output type: an output stage's last step, after
    the epilogue (`ops.expr.apply_epilogue`)."""
    if residual is not None:
        value = value + from_output(load(residual, row, columns), spec.output_dtype)
    T.buffer_store(y, to_output(value, spec.output_dtype), [row, columns])


def from_output(value, output_dtype: str):
    """Loaded `output_dtype` lanes (or a scalar) as float32 (a residual read beside the output)."""
    if output_dtype == "bfloat16":
        return bf16_to_float(value)
    return tirx.Cast(f"float32x{lanes(value)}" if lanes(value) > 1 else "float32", value)
