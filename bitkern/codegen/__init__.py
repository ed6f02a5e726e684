"""Code generation: weight layouts for each target's kernels and the TVM schedule templates.

Entry points: `pack(weight)` (a QuantizedWeight in its kernel layout) and `PackedWeight.to_portable()`;
templates live in `codegen.cpu` (`amx`, `generic`) and are compiled through `codegen.cpu.kernel`.
"""

from .cpu.layout import PackedWeight, layout_for, to_layout


def pack(weight) -> PackedWeight:
    """Lay a QuantizedWeight out for bitkern's kernels (once, at load time)."""
    from ..ttype import QuantizedWeight

    if isinstance(weight, PackedWeight):
        return weight
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"weight must be a QuantizedWeight (see bitkern.quantize), got {type(weight).__name__}")
    if weight.device.type != "cpu":
        raise NotImplementedError(f"bitkern has no kernels for {weight.device.type} tensors yet; "
                                  f"move the weight to the CPU first")
    return to_layout(weight, layout_for(weight.ttype))


__all__ = ["PackedWeight", "layout_for", "pack", "to_layout"]
