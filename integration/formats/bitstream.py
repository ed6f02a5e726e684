"""Codes packed as one continuous little-endian bit stream in int32 words (GPTQ's layout), and back.

Code i of a stream occupies bits [i·bits, (i+1)·bits) of the concatenated words, so 3-bit codes straddle
word boundaries (every 3 words hold 32 codes); 2-, 4- and 8-bit codes fill whole words.  bitkern's own
layout never straddles (`bitkern.ttype.pack`), so imports repack.
"""

from __future__ import annotations

import math

import torch

_MASK32 = (1 << 32) - 1


def _block(bits: int) -> tuple[int, int]:
    """(words, codes) of the smallest whole number of words holding whole codes."""
    words = bits // math.gcd(bits, 32)
    return words, 32 * words // bits


def block_codes(bits: int) -> int:
    """Codes per block: a stream's length must be a multiple of it (32 for 3-bit codes, else 32 // bits)."""
    return _block(bits)[1]


def stream_length(count: int, bits: int) -> int:
    """Words that `count` codes occupy; `count` must fill whole blocks (32 codes for 3-bit streams)."""
    words, codes = _block(bits)
    return count // codes * words


def unpack_stream(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The uint8 codes of int32 `words` packed along `dim` (each run of words along `dim` one stream)."""
    per_block_words, per_block_codes = _block(bits)
    moved = words.movedim(dim, 0).to(torch.int64) & _MASK32
    blocks = moved.reshape(moved.shape[0] // per_block_words, per_block_words, *moved.shape[1:])
    mask = (1 << bits) - 1
    codes = []
    for i in range(per_block_codes):
        word, offset = divmod(i * bits, 32)
        value = blocks[:, word] >> offset
        if offset + bits > 32:
            value = value | (blocks[:, word + 1] << (32 - offset))
        codes.append(value & mask)
    stacked = torch.stack(codes, 1).reshape(-1, *moved.shape[1:])
    return stacked.to(torch.uint8).movedim(0, dim)


def pack_stream(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding integer `codes` (in [0, 2**bits)) packed along `dim`: the inverse of `unpack_stream`."""
    per_block_words, per_block_codes = _block(bits)
    moved = codes.movedim(dim, 0).to(torch.int64)
    if moved.shape[0] % per_block_codes:
        raise ValueError(f"{moved.shape[0]} codes do not fill whole words of {bits}-bit codes; the packed axis "
                         f"must be a multiple of {per_block_codes}")
    blocks = moved.reshape(moved.shape[0] // per_block_codes, per_block_codes, *moved.shape[1:])
    words = torch.zeros(blocks.shape[0], per_block_words, *moved.shape[1:], dtype=torch.int64, device=codes.device)
    for i in range(per_block_codes):
        word, offset = divmod(i * bits, 32)
        words[:, word] |= (blocks[:, i] << offset) & _MASK32
        if offset + bits > 32:
            words[:, word + 1] |= blocks[:, i] >> (32 - offset)
    flat = words.reshape(-1, *moved.shape[1:])
    return (flat - ((flat >> 31) << 32)).to(torch.int32).movedim(0, dim)


def add_to_fields(words: torch.Tensor, bits: int, delta: int) -> torch.Tensor:
    """Add `delta` to every field of int32 `words` as whole-word arithmetic modulo 2**32 (a field's carry or
    borrow runs into the next field), as gptqmodel converts GPTQ v1 zeros (2-, 4-, 8-bit)."""
    per_word = 32 // bits
    ones = sum(1 << (bits * i) for i in range(per_word))
    total = (words.to(torch.int64) + delta * ones) & _MASK32
    return (total - ((total >> 31) << 32)).to(torch.int32)
