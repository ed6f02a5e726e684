"""Bit packing: documented layout, round trips over random shapes and widths, and input errors."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitkern import ttype

WIDTHS = [1, 2, 3, 4, 5, 6, 7, 8, 16, 32]


@settings(max_examples=150, deadline=None)
@given(bits=st.sampled_from(WIDTHS), shape=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       last=st.integers(1, 70), storage=st.sampled_from([torch.int32, torch.uint8]), seed=st.integers(0, 2**31))
def test_pack_unpack_round_trip(bits, shape, last, storage, seed):
    shape = (*shape[:-1], last)
    codes = torch.randint(0, 1 << bits, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    packed = ttype.pack(codes, bits, storage)
    assert packed.dtype == storage
    assert packed.shape == (*shape[:-1], ttype.packed_length(last, bits, storage))
    unpacked = ttype.unpack(packed, bits, shape)
    assert unpacked.dtype == ttype.code_dtype(bits)
    assert torch.equal(unpacked.long(), codes)


@settings(max_examples=150, deadline=None)
@given(bits=st.sampled_from(WIDTHS), rows=st.integers(1, 6), last=st.integers(1, 40),
       storage=st.sampled_from([torch.int32, torch.uint8]), spare=st.integers(0, 5), seed=st.integers(0, 2**31))
def test_unpack_reads_packed_data_of_any_strides(bits, rows, last, storage, spare, seed):
    """Packed data as views hand it over: [rows, L] taken from a column-major buffer (strides (1, rows + spare)),
    which torch calls contiguous when L is 1 (one word or byte per row, e.g. at most 8 4-bit codes) whatever its
    last stride is."""
    codes = torch.randint(0, 1 << bits, (rows, last), generator=torch.Generator().manual_seed(seed))
    packed = ttype.pack(codes, bits, storage)
    length = packed.shape[-1]
    wide = torch.zeros(length + spare, rows + spare, dtype=storage)
    view = wide.T[:rows, :length]
    view.copy_(packed)
    assert view.stride() == (1, rows + spare)
    assert torch.equal(ttype.unpack(view, bits, (rows, last)).long(), codes)


@pytest.mark.parametrize("bits, per_word", [(1, 32), (2, 16), (3, 10), (4, 8), (5, 6), (6, 5), (7, 4), (8, 4),
                                            (16, 2), (32, 1)])
def test_codes_per_word(bits, per_word):
    assert ttype.codes_per_word(bits) == per_word


def test_three_bit_layout_is_ten_codes_per_word_little_endian():
    codes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 7])
    words = ttype.pack(codes, 3)
    expected_first = sum(int(c) << (3 * i) for i, c in enumerate(codes[:10]))
    assert words.tolist() == [expected_first, 7]  # top 2 bits of each word unused; 11th code starts word 2
    assert words.shape == (2,)


def test_four_bit_layout_matches_gptq_order():
    """GPTQ packs 8 nibbles per int32 with element 0 in the lowest bits; bit 31 set gives a negative int32."""
    codes = torch.tensor([0xF, 0x1, 0x2, 0x3, 0x4, 0x5, 0x6, 0x9])
    word = ttype.pack(codes, 4).item()
    assert word == 0x9654321F - (1 << 32)
    assert ttype.pack(codes, 4, torch.uint8).tolist() == [0x1F, 0x32, 0x54, 0x96]


def test_uint8_storage_is_the_byte_view_of_the_words():
    codes = torch.randint(0, 8, (4, 23), generator=torch.Generator().manual_seed(0))
    words = ttype.pack(codes, 3)
    as_bytes = ttype.pack(codes, 3, torch.uint8)
    assert as_bytes.shape == (4, 4 * math.ceil(23 / 10))
    assert torch.equal(as_bytes, words.contiguous().view(torch.uint8))  # little-endian host
    assert ttype.pack(torch.zeros(5, dtype=torch.long), 4, torch.uint8).shape == (3,)


def test_pack_errors_name_the_argument():
    with pytest.raises(TypeError, match="values must hold integer codes"):
        ttype.pack(torch.zeros(4), 4)
    with pytest.raises(ValueError, match=r"values must lie in \[0, 2\*\*4\)"):
        ttype.pack(torch.tensor([16]), 4)
    with pytest.raises(ValueError, match=r"values must lie"):
        ttype.pack(torch.tensor([-1]), 4)
    with pytest.raises(ValueError, match="bits=9 is out of range"):
        ttype.pack(torch.tensor([1]), 9)
    with pytest.raises(ValueError, match="bits=0 is out of range"):
        ttype.unpack(torch.zeros(1, dtype=torch.int32), 0, (1,))
    with pytest.raises(ValueError, match="storage="):
        ttype.pack(torch.tensor([1]), 4, torch.int16)


def test_unpack_errors_name_the_argument():
    with pytest.raises(TypeError, match="packed must be a torch.int32 or torch.uint8 tensor"):
        ttype.unpack(torch.zeros(2, dtype=torch.int64), 4, (16,))
    with pytest.raises(TypeError, match="packed must be"):
        ttype.unpack(torch.zeros(2, dtype=torch.float32), 4, (16,))
    with pytest.raises(ValueError, match=r"shape=\(17,\) needs packed data of shape \(3,\)"):
        ttype.unpack(torch.zeros(2, dtype=torch.int32), 4, (17,))
