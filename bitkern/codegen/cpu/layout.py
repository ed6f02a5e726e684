"""Offline weight layout transforms for the CPU kernels (LADDER's slice / map / pad / convert at pack time).

"tile16" (every width): N is sliced into tiles of 16 output rows and K-words are laid out tile-major,
qweight[N/16, words, 16], so one 64-byte load gives the same word for 16 rows (a vector over N).  Inside
each 32-bit word the codes are mapped so that the first half of the positions holds the even k's and the
second half the odd k's of its 32 // bits consecutive k's: for 1-, 2- and 4-bit codes, shifting the word
by j·bits puts (k=2j, k=2j+1) in the two 16-bit halves, exactly one row of an AMX bf16 B tile.  N and K
are padded with zero codes (to 16 rows, and to a multiple of both the 32-deep AMX step and the codes of a
word); scales and zeros are laid out [N/16, groups, 16].
"rowmajor": the portable layout itself (kernels that read QuantizedWeight tensors as they are).
"""

from __future__ import annotations

import logging
import math

import torch

from ...ttype import (Layout, QuantizedWeight, StoredWeight, WeightFormat, codes_per_word, effective_group_size, get,
                      pack, packed_length, torch_dtype, unpack)
from ...ttype.weight import weight_format
from ..words import WORD_MAPPED_BITS, map_codes, map_words, trim_words, unmap_codes, unmap_words

AMX_TILE_ROWS = 16
AMX_STEP_K = 32
TILE16_BITS = (1, 2, 4)  # widths whose words split into 16-bit halves of whole codes (AMX, lookup tables)
ALIGNMENT = 64  # TVM's kernels assume 64-byte aligned tensors and use aligned vector loads
_CHUNK_WORDS = 1 << 18  # words mapped at a time when laying out (the temporaries stay in cache)
log = logging.getLogger("bitkern")


class PackedWeight(StoredWeight):
    """A QuantizedWeight in a kernel layout; `to_portable()` gives back the portable QuantizedWeight."""

    def __init__(self, layout, ttype, shape, group_size: int, zero_mode: str, qweight: torch.Tensor,
                 scales: torch.Tensor, zeros: torch.Tensor | None = None, tensor_scale: torch.Tensor | None = None):
        super().__init__(weight_format(ttype, shape, group_size, zero_mode, scales, layout), qweight, scales, zeros,
                         tensor_scale)

    @property
    def padded_k(self) -> int:
        return padded_k(self.shape[1], self.ttype.bits) if self.layout == Layout.TILE16 else self.shape[1]

    @classmethod
    def empty(cls, format: WeightFormat, device) -> "PackedWeight":
        """A weight of `format` with uninitialised tensors on `device` (meta: shapes and dtypes only), in the shapes
        its layout gives them and the format's storage dtypes: what a checkpoint's tensors are checked against
        and loaded into."""
        dtypes = ("int32", format.scale_dtype, format.zero_dtype, "float32")
        return cls.from_format(format, *(None if shape is None else
                                         torch.empty(shape, dtype=torch_dtype(dtype), device=device)
                                         for shape, dtype in zip(cls.tensor_shapes(format), dtypes)))

    @staticmethod
    def tensor_shapes(format: WeightFormat) -> tuple:
        """The shapes of qweight, scales, zeros and tensor_scale (None where the format has none) of a weight of
        `format` in its layout (rowmajor or tile16), as `to_layout` makes them."""
        ttype = get(format.dtype)
        n, k = format.shape
        groups = k // effective_group_size(format.group_size, k)
        if format.layout == Layout.ROWMAJOR:
            codes, per_group = (n, packed_length(k, ttype.bits)), (n, groups)
        elif format.layout == Layout.TILE16:
            tiles = -(-n // AMX_TILE_ROWS)
            codes = (tiles, padded_k(k, ttype.bits) // codes_per_word(ttype.bits), AMX_TILE_ROWS)
            per_group = (tiles, groups, AMX_TILE_ROWS)
        else:
            raise ValueError(f"layout={format.layout.value!r} is not a CPU layout; accepted: ['tile16', 'rowmajor']")
        return codes, per_group, None if format.zero_dtype is None else per_group, () if ttype.tensor_scale else None

    def kernel_arguments(self) -> tuple[torch.Tensor, ...]:
        """qweight, scales, zeros and tensor_scale (as [1]) as the CPU kernels take them, 64-byte aligned;
        made once for a given set of tensors (per call, it is a few identity checks)."""
        made = self.__dict__.get("_kernel_arguments")
        if made is None or made[0] is not self.qweight or made[1] is not self.scales or made[2] is not self.zeros \
                or made[3] is not self.tensor_scale:
            parts = (self.qweight, self.scales, self.zeros, self.tensor_scale)
            arguments = tuple(aligned(t.reshape(1) if t is self.tensor_scale else t) for t in parts if t is not None)
            made = self.__dict__["_kernel_arguments"] = (*parts, arguments)
        return made[4]

    def to_portable(self) -> QuantizedWeight:
        """The same weight in the portable layout (for checkpoints)."""
        if self.layout == Layout.ROWMAJOR:
            return QuantizedWeight(self.ttype, self.shape, self.group_size, self.zero_mode, self.qweight,
                                   self.scales, self.zeros, self.tensor_scale)
        n, k = self.shape
        bits = self.ttype.bits
        words = self.qweight.permute(0, 2, 1).reshape(-1, self.qweight.shape[1])[:n]
        untile = (lambda t: None if t is None else t.permute(0, 2, 1).reshape(-1, t.shape[1])[:n].contiguous())
        if bits in WORD_MAPPED_BITS:
            qweight = trim_words(unmap_words(words, bits)[:, :packed_length(k, bits)].contiguous(), k, bits)
        else:
            codes = unmap_codes(unpack(words, bits, (n, words.shape[1] * codes_per_word(bits))), bits)[:, :k]
            qweight = pack(codes, bits)
        return QuantizedWeight(self.ttype, self.shape, self.group_size, self.zero_mode, qweight,
                               untile(self.scales), untile(self.zeros), self.tensor_scale)


def padded_k(k: int, bits: int) -> int:
    """K rounded up to a multiple of the AMX step and of the codes one word holds."""
    unit = math.lcm(AMX_STEP_K, codes_per_word(bits))
    return math.ceil(k / unit) * unit


def to_layout(weight: QuantizedWeight, layout: str) -> PackedWeight:
    """Transform a portable QuantizedWeight into `layout` (see the module docstring)."""
    if layout == Layout.ROWMAJOR:
        return PackedWeight(Layout.ROWMAJOR, weight.ttype, weight.shape, weight.group_size, weight.zero_mode,
                            weight.qweight, weight.scales, weight.zeros, weight.tensor_scale)
    if layout != Layout.TILE16:
        raise ValueError(f"layout={layout!r} is not a CPU layout; accepted: ['tile16', 'rowmajor']")
    bits = weight.ttype.bits
    n, k = weight.shape
    rows = math.ceil(n / AMX_TILE_ROWS) * AMX_TILE_ROWS
    tile = (lambda t: None if t is None else _tile_rows(t, rows))
    if bits in WORD_MAPPED_BITS:
        words = _mapped_tiles(weight.qweight, k, bits, rows)
    else:
        codes = torch.nn.functional.pad(weight.codes(), (0, padded_k(k, bits) - k, 0, rows - n))
        words = tile(pack(map_codes(codes, bits), bits))
    return PackedWeight(Layout.TILE16, weight.ttype, weight.shape, weight.group_size, weight.zero_mode, words,
                        tile(weight.scales), tile(weight.zeros), weight.tensor_scale)


def _mapped_tiles(qweight: torch.Tensor, k: int, bits: int, rows: int) -> torch.Tensor:
    """Portable words -> tile16 words [rows/16, padded words, 16], mapped a chunk of 16-row tiles at a time
    (so the temporaries stay in cache); padding is zero."""
    n, length = qweight.shape
    tiles = torch.empty(rows // AMX_TILE_ROWS, padded_k(k, bits) // codes_per_word(bits), AMX_TILE_ROWS,
                        dtype=torch.int32, device=qweight.device)
    tiles[:, length:] = 0  # the padded words; the loop writes all others (and zero rows past N)
    step = max(1, _CHUNK_WORDS // (length * AMX_TILE_ROWS)) * AMX_TILE_ROWS
    for start in range(0, n, step):
        mapped = map_words(trim_words(qweight[start:start + step], k, bits), bits)
        mapped = torch.nn.functional.pad(mapped, (0, 0, 0, (-mapped.shape[0]) % AMX_TILE_ROWS))
        first = start // AMX_TILE_ROWS
        tiles[first:first + mapped.shape[0] // AMX_TILE_ROWS, :length] = \
            mapped.view(-1, AMX_TILE_ROWS, length).permute(0, 2, 1)
    return tiles


def _tile_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """[N, C] -> [rows/16, C, 16], zero-padding N to `rows`."""
    padded = torch.nn.functional.pad(tensor, (0, 0, 0, rows - tensor.shape[0]))
    return padded.reshape(rows // AMX_TILE_ROWS, AMX_TILE_ROWS, -1).permute(0, 2, 1).contiguous()


def tile16_shift(k, bits: int):
    """The bit offset of the code of reduction index k (an int or an index expression) inside its tile16
    word: a word's even k's come first, then its odd k's."""
    per_word = codes_per_word(bits)
    within = k % per_word
    return (within // 2 + (within % 2) * ((per_word + 1) // 2)) * bits


class Tile16Storage:
    """The tile16 layout as a weight storage of the Matmul tensor expression (see `bitkern.ops.expr`)."""

    def __init__(self, spec, n: int, k: int):
        from tvm import te

        from ...ops.expr import scale_storage, zero_storage

        self.bits = get(spec.weight_dtype).bits
        self.per_word = codes_per_word(self.bits)
        codes, per_group, zeros, _ = PackedWeight.tensor_shapes(
            WeightFormat(spec.weight_dtype, (n, k), spec.group_size, spec.zero_mode, spec.scale_dtype, Layout.TILE16))
        self.qweight = te.placeholder(codes, "int32", name="qweight")
        self.scales = te.placeholder(per_group, scale_storage(spec), name="scales")
        self.zeros = None if zeros is None else te.placeholder(zeros, zero_storage(spec), name="zeros")

    def code(self, i, j):
        from tvm import tirx

        word = self.qweight[i // AMX_TILE_ROWS, j // self.per_word, i % AMX_TILE_ROWS].astype("uint32")
        shift = tile16_shift(j, self.bits).astype("uint32")
        return tirx.bitwise_and(tirx.shift_right(word, shift), tirx.const((1 << self.bits) - 1, "uint32"))

    def scale(self, i, g):
        return self.scales[i // AMX_TILE_ROWS, g, i % AMX_TILE_ROWS]

    def zero(self, i, g):
        return self.zeros[i // AMX_TILE_ROWS, g, i % AMX_TILE_ROWS]


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or a copy of it that starts on a 64-byte boundary (views that start mid-line would fault
    the kernels' aligned loads; packed weights and torch's own allocations are already aligned)."""
    if tensor.data_ptr() % ALIGNMENT == 0:
        return tensor
    log.debug("bitkern: copying a %s tensor that is not %d-byte aligned", tuple(tensor.shape), ALIGNMENT)
    return tensor.clone()
