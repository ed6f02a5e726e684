"""Code generation: weight layouts for each target's kernels and the TVM schedule templates.

Entry points: `pack(weight)` (a QuantizedWeight in its device's kernel layout) and
`PackedWeight.to_portable()`; templates live in `codegen.cpu` (amx, dot, lut, generic; built by
`codegen.cpu.build`) and `codegen.cuda` (TensorCore GEMM, decode GEMV; built with nvcc).
"""

from .cpu.layout import LAYOUTS as CPU_LAYOUTS
from .cpu.layout import PackedWeight
from .cpu.layout import layout_for as cpu_layout_for
from .cpu.layout import packed_shapes as cpu_packed_shapes
from .cpu.layout import to_layout as cpu_to_layout

CUDA_LAYOUT = "lop3"


def layout_for(ttype, device_type: str = "cpu") -> str:
    """The layout the kernels of a device type read a weight type in."""
    if device_type == "cuda":
        return CUDA_LAYOUT
    if device_type != "cpu":
        raise NotImplementedError(f"bitkern has kernels for cpu and cuda tensors, not {device_type}")
    return cpu_layout_for(ttype)


def to_layout(weight, layout: str) -> PackedWeight:
    """A portable QuantizedWeight in `layout` ("tile16", "rowmajor" or "lop3")."""
    if layout == CUDA_LAYOUT:
        from .cuda import to_lop3

        return to_lop3(weight)
    return cpu_to_layout(weight, layout)


def packed_shapes(layout: str, ttype, shape: tuple[int, int], group_size: int, zero_mode: str) -> dict:
    """{qweight, scales, zeros, tensor_scale: shape, or None where the weight has none} of a weight of `shape`
    [N, K] in `layout`, without making it (group_size resolved: K for per-channel)."""
    if layout == CUDA_LAYOUT:
        from .cuda.layout import lop3_shapes

        return lop3_shapes(ttype, shape, group_size, zero_mode)
    return cpu_packed_shapes(layout, ttype, shape, group_size, zero_mode)


def packed_class(layout: str) -> type:
    """The PackedWeight class of a layout (its `to_portable` inverts that layout)."""
    if layout == CUDA_LAYOUT:
        from .cuda import Lop3Weight

        return Lop3Weight
    if layout not in CPU_LAYOUTS:
        raise ValueError(f"layout={layout!r} is not known; accepted: {[*CPU_LAYOUTS, CUDA_LAYOUT]}")
    return PackedWeight


def pack(weight) -> PackedWeight:
    """Lay a QuantizedWeight out for the kernels of its device (once, at load time): tile16 on CPUs, lop3
    on CUDA GPUs."""
    from ..ttype import QuantizedWeight

    if isinstance(weight, PackedWeight):
        return weight
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"weight must be a QuantizedWeight (see bitkern.quantize), got {type(weight).__name__}")
    return to_layout(weight, layout_for(weight.ttype, weight.device.type))


__all__ = ["CUDA_LAYOUT", "PackedWeight", "layout_for", "pack", "packed_class", "packed_shapes", "to_layout"]
