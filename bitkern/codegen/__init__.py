"""Code generation: weight layouts for each target's kernels and the kernel templates.

Entry points: `pack(weight)` (a QuantizedWeight in its device's kernel layout) and `PackedWeight.to_portable()`;
the templates of a target, `templates("cpu")` / `templates("cuda")` (the registries `cpu.TEMPLATES`,
`cuda.TEMPLATES`), each one object behind the protocol of `template.Template`; `template(name)`;
`build_kernel(spec, n, k, template, config, layout, bucket, device)` (KernelBuildError where the compiler fails).
"""

from ..ttype import Layout
from .cpu.layout import AMX_TILE_ROWS, PackedWeight
from .cpu.layout import to_layout as cpu_to_layout
from .template import KernelBuildError, Template, Work

TARGETS = ("cpu", "cuda")


def templates(target: str) -> list[Template]:
    """The registry of `target`'s templates ("cpu" or "cuda"), in the order the tuner lists them."""
    if target == "cpu":
        from .cpu import TEMPLATES
    elif target == "cuda":
        from .cuda import TEMPLATES
    else:
        raise ValueError(f"target={target!r} is not known; accepted: {list(TARGETS)}")
    return TEMPLATES


def template(name: str) -> Template:
    """The template registered as `name` (on any target)."""
    known = [t for target in TARGETS for t in templates(target)]
    found = next((t for t in known if t.name == name), None)
    if found is None:
        raise ValueError(f"template={name!r} is not known; accepted: {[t.name for t in known]}")
    return found


def build_kernel(spec, n: int, k: int, template_name: str, config, layout, bucket: tuple[int, int], device):
    """The kernel of template `template_name` with `config`, for rows M in `bucket` on `device` (a tuner device
    description: the host CPU, another CPU, a CUDA architecture)."""
    return template(template_name).build(spec, n, k, config, layout, bucket, device)


def layout_for(ttype, device_type: str = "cpu") -> Layout:
    """The layout the kernels of a device type read a weight type in."""
    if device_type == "cuda":
        return Layout.LOP3
    if device_type != "cpu":
        raise NotImplementedError(f"bitkern has kernels for cpu and cuda tensors, not {device_type}")
    return Layout.TILE16  # every CPU template reads tile16


def to_layout(weight, layout) -> PackedWeight:
    """A portable QuantizedWeight in `layout` ("tile16", "rowmajor" or "lop3")."""
    if Layout.of(layout) is Layout.LOP3:
        from .cuda import to_lop3

        return to_lop3(weight)
    return cpu_to_layout(weight, layout)


def tensor_rows(layout, n: int) -> int:
    """The first dimension of a weight's tensors in `layout` for N output rows (tiles of 16 rows in tile16, N padded
    to 16 in lop3)."""
    layout = Layout.of(layout)
    if layout is Layout.TILE16:
        return -(-n // AMX_TILE_ROWS)
    if layout is Layout.LOP3:
        from .cuda.layout import padded_shape

        return padded_shape(n, 1)[0]
    return n


def packed_class(layout) -> type:
    """The PackedWeight class of a layout (its `to_portable` inverts that layout)."""
    if Layout.of(layout) is Layout.LOP3:
        from .cuda import Lop3Weight

        return Lop3Weight
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


__all__ = ["KernelBuildError", "PackedWeight", "Template", "Work", "build_kernel", "layout_for", "pack", "packed_class",
           "template", "templates", "tensor_rows", "to_layout"]
