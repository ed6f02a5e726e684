"""The CUDA weight layout "lop3": LADDER's pad and map, done once at pack time.

pad: N is padded to a multiple of 16 (the mma tile) and K to a multiple of 128 (so every kernel's k-step
and every 128-bit load stays inside the tensor) with zero codes; scales and zeros are padded with zeros,
so padded elements decode to exactly 0.  Per-channel weights (group_size == K) keep one scale column.
map: inside each 32-bit word of C = 32 / bits codes, position q holds the code of k = 2q for q < C/2 and
of k = 2(q - C/2) + 1 for q >= C/2.  The LOP3 decode turns the word into C/2 pairs (16-bit lanes), pair
i taking the codes at positions i and i + C/2 — that is, elements 2i and 2i + 1, so the decoded registers
hold the k's in their natural order and land in shared memory exactly as ldmatrix reads them.
Words are row-major, qweight[N_pad, K_pad / C]: a 128-bit load reads 4·C consecutive k of one row.
"""

from __future__ import annotations

import math

import torch

from ...ttype import Layout, QuantizedWeight, WeightFormat, codes_per_word, get, packed_length
from ..cpu.layout import PackedWeight
from ..words import map_words, trim_words, unmap_words

LOP3_BITS = (1, 2, 4, 8)
N_GRAIN = 16
K_GRAIN = 128


def padded_shape(n: int, k: int) -> tuple[int, int]:
    """(N, K) rounded up to the layout's granules."""
    return math.ceil(n / N_GRAIN) * N_GRAIN, math.ceil(k / K_GRAIN) * K_GRAIN


def layout_group(group_size: int, k: int) -> int:
    """Elements per scale column in the layout: the group size, or all of padded K for per-channel."""
    return padded_shape(1, k)[1] if group_size == k else group_size


def type_unsupported(ttype) -> str | None:
    """Why the layout (and the LOP3 decode) cannot hold codes of this width, or None."""
    if ttype.bits not in LOP3_BITS:
        return (f"layout {Layout.LOP3.value!r} holds {list(LOP3_BITS)}-bit types; {ttype.name!r} has {ttype.bits} bits "
                f"(it runs on the CPU kernels only)")
    return None


def check_type(ttype) -> None:
    """Raise unless the layout (and the LOP3 decode) holds codes of this width."""
    if (reason := type_unsupported(ttype)) is not None:
        raise ValueError(reason)


class Lop3Weight(PackedWeight):
    """A QuantizedWeight in the "lop3" layout (see the module docstring); `to_portable()` inverts it."""

    @property
    def padded_shape(self) -> tuple[int, int]:
        return padded_shape(*self.shape)

    @property
    def padded_k(self) -> int:
        return self.padded_shape[1]

    @property
    def layout_group(self) -> int:
        return layout_group(self.group_size, self.shape[1])

    @staticmethod
    def tensor_shapes(format: WeightFormat) -> tuple:
        """The shapes of qweight, scales, zeros and tensor_scale (None where the format has none) of a weight of
        `format` in this layout, as `to_lop3` makes them."""
        if format.layout != Layout.LOP3:
            raise ValueError(f"layout={format.layout.value!r} is not the CUDA layout {Layout.LOP3.value!r}")
        ttype = get(format.dtype)
        check_type(ttype)
        n_pad, k_pad = padded_shape(*format.shape)
        per_group = (n_pad, math.ceil(k_pad / layout_group(format.group_size, format.shape[1])))
        return ((n_pad, packed_length(k_pad, ttype.bits)), per_group, None if format.zero_dtype is None else per_group,
                () if ttype.tensor_scale else None)

    def to_portable(self) -> QuantizedWeight:
        """The same weight in the portable layout, bit for bit."""
        n, k = self.shape
        n_pad, k_pad = self.padded_shape
        bits = self.ttype.bits
        words = unmap_words(self.qweight[:n], bits)[:, :packed_length(k, bits)].contiguous()
        groups = k // self.group_size
        crop = (lambda t: None if t is None else t[:n, :groups].contiguous())
        return QuantizedWeight(self.ttype, self.shape, self.group_size, self.zero_mode, trim_words(words, k, bits),
                               crop(self.scales), crop(self.zeros), self.tensor_scale)


def to_lop3(weight: QuantizedWeight) -> Lop3Weight:
    """Transform a portable QuantizedWeight into the "lop3" layout, on the weight's device."""
    if not isinstance(weight, QuantizedWeight):
        raise TypeError(f"weight must be a QuantizedWeight (see bitkern.quantize), got {type(weight).__name__}")
    check_type(weight.ttype)
    n, k = weight.shape
    n_pad, k_pad = padded_shape(n, k)
    bits = weight.ttype.bits
    words = trim_words(weight.qweight, k, bits)
    words = torch.nn.functional.pad(words, (0, k_pad // codes_per_word(bits) - words.shape[1], 0, n_pad - n))
    columns = math.ceil(k_pad / layout_group(weight.group_size, k))
    pad = (lambda t: None if t is None else
           torch.nn.functional.pad(t, (0, columns - t.shape[1], 0, n_pad - n)).contiguous())
    return Lop3Weight(Layout.LOP3, weight.ttype, weight.shape, weight.group_size, weight.zero_mode,
                      map_words(words, bits),
                      pad(weight.scales), pad(weight.zeros), weight.tensor_scale)
