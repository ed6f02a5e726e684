"""The CPU decode-attention kernel (`bitkern.codegen.cpu.attention`) against the float64 reference of
`bitkern.ops.attention`: every dtype and mask kind, group sizes and head dimensions, cache lengths around the
16-position steps, rows below and above the parallel threshold, masked-out positions, left padding, extreme
scores; fuzzed shapes."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitkern.cache.attention import attention_kernel
from bitkern.codegen.cpu.attention import PARALLEL_ROWS
from bitkern.ops.attention import LANES, DecodeAttention, reference

TOLERANCE = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _inputs(batch, kv_heads, groups, length, dim, dtype, mask_kind, seed=0, spread=1.0):
    generator = torch.Generator().manual_seed(seed)
    rows = batch * kv_heads
    query = (torch.randn(rows, groups, dim, generator=generator) * spread).to(dtype)
    key, value = (torch.randn(rows, length, dim, generator=generator).to(dtype) for _ in range(2))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(batch, length, generator=generator) > 0.4
        mask[:, -1] = True  # the current token always attends to itself
        mask[0, : length // 2] = False  # left padding of the first sequence
    elif mask_kind == "additive":
        mask = torch.randn(batch, length, generator=generator)
        mask[0, : length // 2] = -math.inf
        mask[:, -1] = 0.0
    return query, key, value, mask


def _run(query, key, value, mask, scale):
    rows, groups, dim = query.shape
    kind = "none" if mask is None else "bool" if mask.dtype == torch.bool else "additive"
    kernel = attention_kernel(DecodeAttention(DTYPE_NAMES[query.dtype], groups, dim, kind))
    length = key.shape[1]
    scratch = torch.full((rows, groups, -(-length // LANES) * LANES), float("nan"))
    out = torch.empty_like(query)
    arguments = () if mask is None else (mask.view(torch.uint8) if kind == "bool" else mask.float(),)
    kernel(query, key, value, *arguments, torch.tensor([scale]), scratch, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 73])
def test_kernel_matches_the_reference(dtype, mask_kind, length):
    query, key, value, mask = _inputs(2, 4, 4, length, 64, dtype, mask_kind)
    if mask is not None and length == 1:
        mask[:] = True if mask.dtype == torch.bool else 0.0
    expected = reference(query, key, value, mask, 0.125)
    torch.testing.assert_close(_run(query, key, value, mask, 0.125).double(), expected.double(),
                               rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("groups, dim", [(1, 16), (2, 128), (7, 48), (8, 256)])
@pytest.mark.parametrize("rows", [1, PARALLEL_ROWS - 1, PARALLEL_ROWS, 3 * PARALLEL_ROWS + 1])
def test_group_sizes_head_dimensions_and_rows(groups, dim, rows):
    query, key, value, mask = _inputs(rows, 1, groups, 33, dim, torch.float32, "bool", seed=rows)
    expected = reference(query, key, value, mask, dim ** -0.5)
    torch.testing.assert_close(_run(query, key, value, mask, dim ** -0.5).double(), expected.double(), rtol=2e-6,
                               atol=2e-6)


def test_extreme_scores_stay_finite_and_exact_where_one_position_dominates():
    """Scores of ±1e4 (softmax saturates): the kernel subtracts the maximum first, so nothing overflows, and a
    dominating position gives its value row exactly."""
    query, key, value, mask = _inputs(1, 2, 2, 40, 32, torch.float32, "none", spread=200.0)
    out = _run(query, key, value, mask, 1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(query, key, value, mask, 1.0), rtol=1e-5, atol=1e-5)


def test_masked_positions_get_no_weight():
    """A masked position's value may be anything (even inf or NaN in an unused cache slot): it contributes 0."""
    query, key, value, mask = _inputs(1, 2, 4, 20, 16, torch.bfloat16, "bool")
    poisoned = value.clone()
    poisoned[:, ~mask[0]] = float("inf")
    key_poisoned = key.clone()
    key_poisoned[:, ~mask[0]] = 1e30
    torch.testing.assert_close(_run(query, key_poisoned, poisoned, mask, 0.25), _run(query, key, value, mask, 0.25))


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 3), kv_heads=st.integers(1, 4), groups=st.sampled_from([1, 4]),
       length=st.integers(1, 130), dim=st.sampled_from([16, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), mask_kind=st.sampled_from(["none", "bool", "additive"]),
       seed=st.integers(0, 2 ** 16))
def test_fuzzed_shapes(batch, kv_heads, groups, length, dim, dtype, mask_kind, seed):
    query, key, value, mask = _inputs(batch, kv_heads, groups, length, dim, dtype, mask_kind, seed=seed)
    if mask is not None and mask.dtype == torch.bool:
        mask[:, -1] = True
    expected = reference(query, key, value, mask, dim ** -0.5)
    torch.testing.assert_close(_run(query, key, value, mask, dim ** -0.5).double(), expected.double(),
                               rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
