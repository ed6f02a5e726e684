"""Bit packing of integer codes into storage words, and the TVM expression that reads one code back.

Layout (the portable layout checkpoints use; kernels' tile layouts are derived from it by codegen):
codes are packed along the last axis into little-endian 32-bit words, `32 // bits` codes per word,
code i of a word in bits [i*bits, (i+1)*bits).  Widths that do not divide 32 (3, 5, 6, 7) leave the top
`32 % bits` bits of each word zero, so no code straddles two words (LADDER §4.1.1: ten 3-bit codes per
word).  For 16-bit codes two per word; for 32-bit codes one.  Storage int32 holds the words as signed
integers (as GPTQ checkpoints do); storage uint8 holds the same bit stream as little-endian bytes,
cut after the last byte that holds a code when `bits` divides 32 (so 4-bit codes take ceil(n/2) bytes),
else whole words.
"""

from __future__ import annotations

import math

import torch

from .types import STORAGE_BITS, as_signed, check_codes

STORAGE_DTYPES = (torch.int32, torch.uint8)


def codes_per_word(bits: int) -> int:
    """How many `bits`-bit codes one 32-bit storage word holds."""
    _check_bits(bits)
    return 32 // bits


def packed_length(length: int, bits: int, storage: torch.dtype = torch.int32) -> int:
    """Number of storage elements that `length` packed codes occupy along the packed axis."""
    words = math.ceil(length / codes_per_word(bits))
    if storage == torch.int32:
        return words
    return math.ceil(length * bits / 8) if 32 % bits == 0 else 4 * words


def code_dtype(bits: int) -> torch.dtype:
    """The integer dtype `unpack` returns codes in: uint8 up to 8 bits, int32 for 16, int64 for 32."""
    _check_bits(bits)
    return torch.uint8 if bits <= 8 else torch.int32 if bits <= 16 else torch.int64


def pack(values: torch.Tensor, bits: int, storage: torch.dtype = torch.int32) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) along the last axis into `storage` (torch.int32 or torch.uint8)."""
    _check_bits(bits)
    if storage not in STORAGE_DTYPES:
        raise ValueError(f"storage={storage} is not supported; accepted: {list(STORAGE_DTYPES)}")
    values = check_codes(values, bits, "values")
    if values.dim() == 0:
        raise ValueError("values must have at least one dimension (codes are packed along the last)")
    return pack_codes(values, bits, storage)


def pack_codes(values: torch.Tensor, bits: int, storage: torch.dtype = torch.int32) -> torch.Tensor:
    """`pack` without checking the codes (callers that made them, such as quantization, know they fit)."""
    if 8 % bits == 0:
        stream = _byte_stream(values, bits)
        return stream.view(torch.int32) if storage == torch.int32 else \
            stream[..., :packed_length(values.shape[-1], bits, torch.uint8)].contiguous()
    per_word = 32 // bits
    length = values.shape[-1]
    words = math.ceil(length / per_word)
    codes = torch.nn.functional.pad(values.long(), (0, words * per_word - length))
    shifts = torch.arange(per_word, device=values.device, dtype=torch.int64) * bits
    word_values = (codes.reshape(*values.shape[:-1], words, per_word) << shifts).sum(-1)
    if storage == torch.int32:
        return as_signed(word_values, 32).to(torch.int32)
    byte_shifts = torch.arange(4, device=values.device, dtype=torch.int64) * 8
    stream = ((word_values.unsqueeze(-1) >> byte_shifts) & 0xFF).reshape(*values.shape[:-1], 4 * words)
    return stream[..., :packed_length(length, bits, torch.uint8)].to(torch.uint8)


# Widths that divide 8 pack a byte's codes as one little-endian integer of that many bytes: its code i sits in
# byte i, and OR-ing it with itself shifted right by i·(8 - bits) gathers every code into the low byte.
_BYTES_AS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _byte_stream(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of a width dividing 8, packed into bytes (uint8) padded to whole 32-bit words: byte j holds
    codes j·(8/bits) ... at increasing bit positions, so four bytes viewed as an int32 are the packed word."""
    per_byte, per_word = 8 // bits, 32 // bits
    codes = values.to(torch.uint8)
    if values.shape[-1] % per_word:
        codes = torch.nn.functional.pad(codes, (0, per_word - values.shape[-1] % per_word))
    codes = codes.contiguous()
    if per_byte == 1:
        return codes
    grouped = codes.view(_BYTES_AS[per_byte])
    gathered = grouped.clone()
    for i in range(1, per_byte):
        gathered |= grouped >> (i * (8 - bits))
    return gathered.to(torch.uint8)


def _codes_of_bytes(stream: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_byte_stream` (before its padding is cut): the codes of each byte, 8 // bits per byte."""
    per_byte = 8 // bits
    if per_byte == 1:
        return stream
    wide = stream.to(_BYTES_AS[per_byte])
    spread = wide.clone()
    for i in range(1, per_byte):
        spread |= wide << (i * (8 - bits))
    mask = sum(((1 << bits) - 1) << (8 * i) for i in range(per_byte))
    return (spread & mask).view(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, shape) -> torch.Tensor:
    """Inverse of `pack`: codes of the given `shape` (the unpacked tensor's shape) in `code_dtype(bits)`."""
    _check_bits(bits)
    if not isinstance(packed, torch.Tensor) or packed.dtype not in STORAGE_DTYPES:
        got = packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise TypeError(f"packed must be a torch.int32 or torch.uint8 tensor, got {got}")
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("shape must have at least one dimension")
    expected = (*shape[:-1], packed_length(shape[-1], bits, packed.dtype))
    if tuple(packed.shape) != expected:
        raise ValueError(f"shape={shape} needs packed data of shape {expected} for {bits}-bit codes in "
                         f"{packed.dtype}, got {tuple(packed.shape)}")
    if 8 % bits == 0:
        stream = _row_major(packed)
        stream = stream.view(torch.uint8) if packed.dtype == torch.int32 else stream
        return _codes_of_bytes(stream, bits)[..., :shape[-1]].contiguous()
    if packed.dtype == torch.int32:
        words = packed.long() & 0xFFFFFFFF
    else:
        stream = torch.nn.functional.pad(packed.long(), (0, (-packed.shape[-1]) % 4))
        byte_shifts = torch.arange(4, device=packed.device, dtype=torch.int64) * 8
        words = (stream.reshape(*stream.shape[:-1], -1, 4) << byte_shifts).sum(-1)
    per_word = 32 // bits
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int64) * bits
    codes = ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(*shape[:-1], -1)
    return codes[..., :shape[-1]].to(code_dtype(bits))


def _row_major(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with row-major strides, copied only where it has other ones.  torch calls a tensor contiguous
    whatever the stride of a dimension of size 1, and `contiguous()` returns it as it is (a [N, 1] slice of a
    wider tensor of words, e.g. one row of at most 8 4-bit codes, can have stride 3 there), but reinterpreting its
    elements as bytes (`view(torch.uint8)`) needs stride 1 on the last dimension."""
    tensor = tensor.contiguous()
    return tensor if tensor.stride(-1) == 1 else tensor.clone(memory_format=torch.contiguous_format)


def tvm_unpack(words, index: tuple, bits: int):
    """TVM expression (uint32) of the code at `index` (last entry: position along the packed axis)
    read from a tensor/buffer of int32 words in the layout above."""
    from tvm import tirx

    per_word = codes_per_word(bits)
    *outer, position = index
    word = tirx.Cast("uint32", words[(*outer, position // per_word)])
    shift = tirx.Cast("uint32", (position % per_word) * bits)
    return tirx.bitwise_and(tirx.shift_right(word, shift), tirx.const((1 << bits) - 1 if bits < 32 else 0xFFFFFFFF,
                                                                       "uint32"))


def _check_bits(bits) -> None:
    if bits not in STORAGE_BITS or isinstance(bits, bool):
        raise ValueError(f"bits={bits!r} is out of range; accepted: {list(STORAGE_BITS)}")
