"""The word map both kernel layouts apply (CPU "tile16", CUDA "lop3"): inside each 32-bit word of 32 // bits
consecutive k's, the even k's go to the first half of the positions and the odd k's to the second half.

For widths dividing 8 the map is a perfect unshuffle of the word's bit fields and runs on whole packed words
with delta swaps (Hacker's Delight 7-2), no unpacking; `map_codes` / `unmap_codes` do it on unpacked codes for
every width.
"""

from __future__ import annotations

import torch

from ..ttype import codes_per_word

WORD_MAPPED_BITS = (1, 2, 4, 8)
# (shift, mask): the swap at shift s exchanges the bit fields under `mask` with those s bits above them
_UNSHUFFLE = ((1, 0x22222222), (2, 0x0C0C0C0C), (4, 0x00F000F0), (8, 0x0000FF00))


def map_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Portable int32 words -> the same words mapped, for widths in WORD_MAPPED_BITS."""
    return _delta_swaps(words, [(s, m) for s, m in _UNSHUFFLE if s >= bits])


def unmap_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `map_words`."""
    return _delta_swaps(words, [(s, m) for s, m in reversed(_UNSHUFFLE) if s >= bits])


def _delta_swaps(words: torch.Tensor, swaps) -> torch.Tensor:
    words = words.clone()
    for shift, mask in swaps:  # the masks leave bit 31 alone, so int32's arithmetic shift is exact under them
        moved = (words ^ (words >> shift)) & mask
        words ^= moved ^ (moved << shift)
    return words


def trim_words(words: torch.Tensor, k: int, bits: int) -> torch.Tensor:
    """Portable words of rows of `k` codes with the unused positions of each row's last word zeroed (as `pack`
    leaves them, whatever a checkpoint put there)."""
    used = (k % codes_per_word(bits)) * bits
    if used == 0:
        return words
    words = words.clone()
    words[:, -1] &= (1 << used) - 1
    return words


def word_order(bits: int) -> torch.Tensor:
    """order[q] = which of a word's consecutive k's the code at position q belongs to."""
    per_word = codes_per_word(bits)
    return torch.cat([torch.arange(0, per_word, 2), torch.arange(1, per_word, 2)])


def map_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unpacked codes [N, K] (K a multiple of a word's codes) -> the same codes in mapped order."""
    grouped = codes.reshape(codes.shape[0], -1, codes_per_word(bits))
    return grouped[..., word_order(bits).to(codes.device)].reshape(codes.shape)


def unmap_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `map_codes`."""
    grouped = codes.reshape(codes.shape[0], -1, codes_per_word(bits))
    return grouped[..., torch.argsort(word_order(bits)).to(codes.device)].reshape(codes.shape)
