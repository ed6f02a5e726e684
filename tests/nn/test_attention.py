"""`bitkern.nn.attention.decode_attention` and its custom op `torch.ops.bitkern.decode_attention`: the float64
reference's results through both, torch.library's own checks of the op (schema, fake tensor, no aliasing), a
compiled graph that calls it, and bad input named before any kernel is built."""

import pytest
import torch

from bitkern.nn.attention import decode_attention
from bitkern.ops.attention import reference


def _inputs(dtype=torch.bfloat16, rows=4, groups=4, length=21, dim=32):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(rows, groups, dim, generator=generator).to(dtype)
    key, value = (torch.randn(rows, length, dim, generator=generator).to(dtype) for _ in range(2))
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[0, :5] = False
    return query, key, value, mask


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float"])
def test_function_and_op_match_the_reference(mask_kind):
    query, key, value, mask = _inputs()
    if mask_kind == "none":
        mask = None
    elif mask_kind == "float":
        mask = torch.where(mask, 0.0, float("-inf")).to(torch.bfloat16)
    expected = reference(query, key, value, mask, 32 ** -0.5)
    torch.testing.assert_close(decode_attention(query, key, value, mask), expected, rtol=1.6e-2, atol=1.6e-2)
    torch.testing.assert_close(torch.ops.bitkern.decode_attention(query, key, value, mask, 32 ** -0.5), expected,
                               rtol=1.6e-2, atol=1.6e-2)


def test_non_contiguous_inputs_give_the_same_result():
    query, key, value, mask = _inputs(torch.float32)
    wide = torch.cat([key, key], dim=2)[:, :, :32]
    assert not wide.is_contiguous()
    torch.testing.assert_close(decode_attention(query, wide, value, mask, 0.2), decode_attention(query, key, value,
                                                                                                 mask, 0.2))


def test_the_op_passes_torch_library_checks_and_compiles():
    query, key, value, mask = _inputs(torch.float32)
    torch.library.opcheck(torch.ops.bitkern.decode_attention.default, (query, key, value, mask, 0.25),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))
    compiled = torch.compile(lambda *a: torch.ops.bitkern.decode_attention(*a) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(query, key, value, mask, 0.25),
                               decode_attention(query, key, value, mask, 0.25) * 2)


def test_bad_input_is_named():
    query, key, value, mask = _inputs(torch.float32)
    cases = [((query.double(), key, value, None), "query.dtype=torch.float64"),
             ((query, key.half(), value, None), "key.dtype=torch.float16 must be the query's"),
             ((query[0], key, value, None), "query must be a 3-D CPU tensor"),
             ((query, key[:, :3], value, None), "key and value must be [4, L, 32]"),
             ((query, key, value, mask[:, :3]), "mask must be None or a bool or float [B, 21]"),
             ((query, key, value, torch.ones(3, 21, dtype=torch.bool)), "with 4 a multiple of B"),
             ((query, key, value, mask.int()), "mask must be None or a bool or float"),
             ((query[..., :24], key[..., :24], value[..., :24], None), "head_dim=24 must be a positive multiple")]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            decode_attention(*arguments)
    with pytest.raises(TypeError, match="must be tensors"):
        decode_attention(query, key, value.numpy())
