"""A stored weight: the frozen format that says what its tensors mean, the layouts they can lie in, and the base
class every weight object shares (`QuantizedWeight` here; the kernel-layout weights of `bitkern.codegen`).

The format travels as one string wherever a weight must cross a boundary that takes only plain values (the
torch.library ops of `bitkern.nn.library`): `WeightFormat.encode()` and `WeightFormat.decode(text)`.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import asdict, dataclass
from enum import Enum

import torch

from .dtypes import dtype_name
from .registry import get

ZERO_MODES = ("none", "gptq", "awq", "hqq")
SCALE_STORAGE = ("float16", "bfloat16", "float32", "uint8")  # uint8: codes of a block-scale type (mxfp4, nvfp4)


class Layout(str, Enum):
    """Where a weight's codes, scales and zeros lie in its tensors (LADDER's layout transforms).  A member is
    also its name as a string ("tile16" == Layout.TILE16), as cache keys and files store it.

    ROWMAJOR: the portable layout of `QuantizedWeight`: qweight [N, words] packed along K (`bitkern.ttype.pack`),
        scales and zeros [N, K / group]; read by the generic CPU template, written into checkpoints.
    TILE16: the CPU kernels' layout: tiles of 16 output rows whose words lie side by side, codes mapped so one
        shift yields an AMX tile row, N and K padded (`bitkern.codegen.cpu.layout`).
    LOP3: the CUDA kernels' layout: N padded to 16 and K to 128, codes permuted inside each word for the LOP3
        decode (`bitkern.codegen.cuda.layout`).
    """

    ROWMAJOR = "rowmajor"
    TILE16 = "tile16"
    LOP3 = "lop3"

    __str__ = str.__str__
    __format__ = str.__format__

    @classmethod
    def of(cls, value) -> "Layout":
        """The layout named `value`; ValueError naming the accepted ones otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"layout={value!r} is not known; accepted: {[member.value for member in cls]}") from None


@dataclass(frozen=True)
class WeightFormat:
    """What a [N, K] weight's tensors mean.

    dtype: the bitkern type of the codes; shape: (N, K); group_size: elements along K per scale (K for
    per-channel); zero_mode: "none", "gptq", "awq" or "hqq"; scale_dtype: what `scales` holds (float16,
    bfloat16, float32, or uint8 codes of a block-scale type); layout: where the codes lie (`Layout`).
    The zeros are uint8 codes ("gptq", "awq") or scale_dtype floats ("hqq"); a tensor scale is float32.
    """

    dtype: str
    shape: tuple[int, int]
    group_size: int
    zero_mode: str
    scale_dtype: str
    layout: Layout

    def __post_init__(self):
        object.__setattr__(self, "dtype", get(self.dtype).name)
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "layout", Layout.of(self.layout))
        if len(self.shape) != 2:
            raise ValueError(f"shape={self.shape} must be (out_features, in_features)")
        if self.zero_mode not in ZERO_MODES:
            raise ValueError(f"zero_mode={self.zero_mode!r} is not known; accepted: {list(ZERO_MODES)}")
        if self.scale_dtype not in SCALE_STORAGE:
            raise ValueError(f"scale_dtype={self.scale_dtype!r} is not known; accepted: {list(SCALE_STORAGE)}")

    @property
    def zero_dtype(self) -> str | None:
        """What `zeros` holds: uint8 codes, the scale dtype (hqq), or None (no zero point)."""
        return {"none": None, "hqq": self.scale_dtype}.get(self.zero_mode, "uint8")

    def encode(self) -> str:
        """The format as one string (a torch.library op argument) of `field=value` pairs joined by ";" and the shape
        as NxK: no quotes or backslashes, so torch.compile's C++ wrapper can put it in a C++ string literal as it
        is.  `decode` inverts it."""
        values = {**asdict(self), "shape": "x".join(map(str, self.shape)), "layout": self.layout.value}
        return ";".join(f"{name}={value}" for name, value in values.items())

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def decode(text: str) -> "WeightFormat":
        """The format an `encode`d string describes (parsed once per string); ValueError if it describes none."""
        try:
            fields = dict(pair.split("=", 1) for pair in text.split(";"))
            fields["shape"] = tuple(int(size) for size in fields["shape"].split("x"))
            fields["group_size"] = int(fields["group_size"])
        except (ValueError, KeyError) as error:
            raise ValueError(f"weight_format={text!r} is not a bitkern weight format ({error!r})") from None
        try:
            return WeightFormat(**fields)  # its own checks name a value it does not know
        except TypeError as error:
            raise ValueError(f"weight_format={text!r} is not a bitkern weight format ({error})") from None


def weight_format(ttype, shape, group_size: int, zero_mode: str, scales: torch.Tensor, layout) -> WeightFormat:
    """The format of a weight with these settings whose scales are `scales` (their dtype is the scale dtype)."""
    return WeightFormat(get(ttype).name, shape, group_size, zero_mode, dtype_name(scales.dtype), layout)


class StoredWeight(abc.ABC):
    """A [N, K] weight stored in a bitkern type: its frozen `format` and its tensors, `TENSORS` in this order
    wherever they travel together.  Base of `QuantizedWeight` (the portable layout) and of the kernel-layout
    weights (`bitkern.codegen.PackedWeight`).  A tensor may be replaced by one of the same format."""

    TENSORS = ("qweight", "scales", "zeros", "tensor_scale")

    def __init__(self, format: WeightFormat, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None = None, tensor_scale: torch.Tensor | None = None):
        self.format = format
        self._ttype = get(format.dtype)
        self.qweight, self.scales, self.zeros, self.tensor_scale = qweight, scales, zeros, tensor_scale

    @classmethod
    def from_format(cls, format: WeightFormat, *tensors) -> "StoredWeight":
        """A weight of this class from its format and tensors (in `TENSORS` order), taken as they are."""
        weight = cls.__new__(cls)
        StoredWeight.__init__(weight, format, *tensors)
        return weight

    @property
    def ttype(self):
        return self._ttype

    @property
    def shape(self) -> tuple[int, int]:
        return self.format.shape

    @property
    def group_size(self) -> int:
        return self.format.group_size

    @property
    def zero_mode(self) -> str:
        return self.format.zero_mode

    @property
    def layout(self) -> Layout:
        return self.format.layout

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def tensors(self) -> tuple:
        """qweight, scales, zeros, tensor_scale (None where the format has none)."""
        return self.qweight, self.scales, self.zeros, self.tensor_scale

    @property
    def nbytes(self) -> int:
        """Bytes of storage: packed codes plus scales, zeros and tensor scale."""
        return sum(t.numel() * t.element_size() for t in self.tensors() if t is not None)

    def to(self, device) -> "StoredWeight":
        """A copy with every tensor on `device`."""
        return self.from_format(self.format, *(None if t is None else t.to(device) for t in self.tensors()))

    @abc.abstractmethod
    def to_portable(self):
        """The same weight as a `QuantizedWeight` (the portable layout), bit for bit."""

    def __repr__(self) -> str:
        n, k = self.shape
        layout = "" if self.layout is Layout.ROWMAJOR else f", layout={self.layout.value!r}"
        return (f"{type(self).__name__}({self.ttype.name}, shape=({n}, {k}), group_size={self.group_size}, "
                f"zero_mode={self.zero_mode!r}{layout}, {self.nbytes} bytes)")
