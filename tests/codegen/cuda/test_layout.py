"""The "lop3" CUDA weight layout: exact inverse back to the portable layout, padding, and the word map."""

import pytest
import torch

import bitkern
from bitkern import ttype
from bitkern.codegen import PackedWeight
from bitkern.codegen.cuda.layout import Lop3Weight, padded_shape, to_lop3
from bitkern.codegen.words import word_order


@pytest.mark.parametrize("name, zero_mode", [("int4", None), ("uint4", "gptq"), ("uint4", "hqq"), ("uint2", "awq"),
                                             ("int2", None), ("int1", None), ("uint1", "gptq"), ("nf4", None),
                                             ("fp4_e2m1", None), ("float8_e4m3", None), ("int8", None),
                                             ("mxfp4", None), ("mxfp8", None), ("nvfp4", None)])
@pytest.mark.parametrize("n, k, group", [(16, 128, 32), (37, 96, 32), (5, 64, -1), (130, 384, 128), (3, 40, -1)])
def test_round_trip_is_bitwise(name, zero_mode, n, k, group):
    t = ttype.get(name)
    if t.block_size > 1 and k % t.block_size:
        pytest.skip("block types need K divisible by their block")
    q = bitkern.quantize(torch.randn(n, k), name, group_size=None if t.block_size > 1 else group, zero_mode=zero_mode)
    packed = to_lop3(q)
    assert isinstance(packed, PackedWeight) and packed.layout == "lop3"
    n_pad, k_pad = padded_shape(n, k)
    assert packed.qweight.shape == (n_pad, k_pad * t.bits // 32) and packed.padded_k == k_pad
    assert packed.scales.shape[0] == n_pad
    back = packed.to_portable()
    for field in ("qweight", "scales", "zeros", "tensor_scale"):
        a, b = getattr(back, field), getattr(q, field)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), field


def test_padding_decodes_to_zero():
    q = bitkern.quantize(torch.randn(20, 100), "uint4", group_size=-1, zero_mode="gptq")
    packed = to_lop3(q)
    assert packed.scales.shape == (32, 1)  # per-channel: one column over all of padded K
    assert torch.all(packed.scales[20:] == 0) and torch.all(packed.zeros[20:] == 0)
    mapped = ttype.unpack(packed.qweight, 4, (32, 128)).view(32, 16, 8)
    codes = torch.empty_like(mapped)
    codes[..., word_order(4)] = mapped
    codes = codes.view(32, 128)
    assert torch.all(codes[20:] == 0) and torch.all(codes[:, 100:] == 0) and torch.equal(codes[:20, :100], q.codes())


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_word_map_puts_even_ks_in_the_low_half(bits):
    per_word = 32 // bits
    order = word_order(bits)
    assert sorted(order.tolist()) == list(range(per_word))
    # pair i (positions i and i + C/2) holds elements 2i and 2i + 1
    for i in range(per_word // 2):
        assert (order[i].item(), order[i + per_word // 2].item()) == (2 * i, 2 * i + 1)


def test_layout_moves_between_devices_and_rejects_other_widths():
    q = bitkern.quantize(torch.randn(16, 128), "int4")
    packed = to_lop3(q).to("cpu")
    assert isinstance(packed, Lop3Weight) and packed.device.type == "cpu"
    with pytest.raises(ValueError, match=r"layout 'lop3' holds \[1, 2, 4, 8\]-bit types; 'int3' has 3 bits"):
        to_lop3(bitkern.quantize(torch.randn(16, 128), "int3"))
    with pytest.raises(TypeError, match="weight must be a QuantizedWeight"):
        to_lop3(torch.zeros(4, 4))
