"""The DecodeAttention spec: hashable, validated; its float64 reference against torch's SDPA with K and V repeated
to every query head (an independent computation)."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from bitkern.ops.attention import DecodeAttention, reference


def test_spec_is_hashable_and_validated():
    assert DecodeAttention("bfloat16", 4, 64, "bool") == DecodeAttention("bfloat16", 4, 64, "bool")
    assert len({DecodeAttention("float32", 1, 16), DecodeAttention("float32", 1, 16, "none")}) == 1
    for arguments, message in ((("float64", 4, 64), "dtype='float64'"), (("float32", 0, 64), "groups=0"),
                               (("float32", 4, 40), "head_dim=40 must be a positive multiple of 16"),
                               (("float32", 4, 64, "causal"), "mask='causal'")):
        with pytest.raises(ValueError, match=re.escape(message)):
            DecodeAttention(*arguments)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_reference_matches_sdpa_over_repeated_heads(mask_kind):
    generator = torch.Generator().manual_seed(0)
    batch, kv_heads, groups, length, dim = 2, 3, 4, 11, 16
    query = torch.randn(batch * kv_heads, groups, dim, generator=generator, dtype=torch.float64)
    key, value = (torch.randn(batch * kv_heads, length, dim, generator=generator, dtype=torch.float64)
                  for _ in range(2))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(batch, length, generator=generator) > 0.3
        mask[:, 0] = True
    elif mask_kind == "additive":
        mask = torch.randn(batch, length, generator=generator, dtype=torch.float64)
        mask[1, 5:] = -math.inf
    ours = reference(query, key, value, mask, 0.3)
    heads = kv_heads * groups
    q = query.reshape(batch, heads, 1, dim)
    k, v = (t.reshape(batch, kv_heads, length, dim).repeat_interleave(groups, dim=1) for t in (key, value))
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None, None, :],
                                            scale=0.3)
    torch.testing.assert_close(ours, theirs.reshape(batch * kv_heads, groups, dim))
