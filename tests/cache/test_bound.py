"""Bound calls (bitkern.cache.bound): a repeated op call of one signature runs the kernel its first, checked call
found, and anything outside that signature (other inputs, moved or replaced weight tensors, bad expert ids, a freed
weight) goes back through the checks."""

import gc

import pytest
import torch

import bitkern
from bitkern.cache import bound, dispatch, forget
from bitkern.nn import library
from bitkern.ttype import WeightFormat

K, N = 64, 32


def _linear(**options):
    torch.manual_seed(0)
    return bitkern.Linear(K, N, dtype="int4", group_size=32, **options).bfloat16()


def _no_lookup(monkeypatch):
    """Make every kernel lookup fail: only a bound call can run."""
    def refuse(*args, **kwargs):
        raise AssertionError("looked the kernel up")
    monkeypatch.setattr(dispatch, "kernel_for", refuse)


@pytest.mark.parametrize("compiled_path", [False, True], ids=["module", "op"])
def test_a_repeated_call_runs_the_bound_kernel_with_the_same_result(monkeypatch, compiled_path):
    layer = _linear()
    x = torch.randn(3, K).bfloat16()
    with torch.inference_mode():
        call = (lambda v: torch.ops.bitkern.linear(v, *layer.op_weight(), layer.bias, torch.bfloat16)) \
            if compiled_path else layer
        first = call(x)
        _no_lookup(monkeypatch)
        again = call(x.clone())
        other = torch.randn(3, K).bfloat16()
        expected = torch.nn.functional.linear(other.float(), layer.dequantize_weight(), layer.bias.float())
        assert torch.equal(first, again)
        torch.testing.assert_close(call(other).float(), expected, rtol=0.02, atol=0.02)


def test_another_signature_goes_through_the_checks():
    layer = _linear()
    with torch.inference_mode():
        layer(torch.randn(2, K).bfloat16())
        with pytest.raises(ValueError, match=f"in_features={K}"):
            torch.ops.bitkern.linear(torch.randn(2, K + 32).bfloat16(), *layer.op_weight(), layer.bias,
                                     torch.bfloat16)
        assert layer(torch.randn(5, K).bfloat16()).shape == (5, N)  # another M: another kernel, found by lookup


def test_replaced_weight_tensors_are_not_the_bound_calls():
    layer = _linear(bias=False)
    x = torch.randn(1, K).bfloat16()
    tensors, weight_format = layer.op_weight()
    with torch.inference_mode():
        first = torch.ops.bitkern.linear(x, tensors, weight_format, None, torch.bfloat16)
        doubled = [tensors[0], library.raw_bits(library.weight_of(tensors, WeightFormat.decode(
            weight_format)).scales * 2), *tensors[2:]]
        second = torch.ops.bitkern.linear(x, doubled, weight_format, None, torch.bfloat16)
    torch.testing.assert_close(second.float(), first.float() * 2, rtol=0.01, atol=0.01)


def test_a_bound_grouped_call_still_checks_the_expert_ids(monkeypatch):
    experts = bitkern.Experts(4, K, N, dtype="int4", group_size=32)
    x = torch.randn(2, K)
    ids = torch.tensor([[0, 3], [1, 2]])
    weights = torch.softmax(torch.randn(2, 2), -1)
    with torch.inference_mode():
        experts(x, ids, weights)
        _no_lookup(monkeypatch)
        experts(x, ids.flip(1), weights)
        with pytest.raises(ValueError, match=r"expert ids outside \[0, 4\)"):
            experts.gate_up.routed(x, torch.tensor([[0, 4], [1, 2]]), epilogue="swiglu")


def test_freeing_a_weight_frees_its_bound_calls():
    layer = _linear()
    with torch.inference_mode():
        layer(torch.randn(1, K).bfloat16())
    key = id(layer.qweight)
    assert key in bound._BOUND
    del layer
    gc.collect()
    assert key not in bound._BOUND


def test_forget_drops_the_bound_calls(monkeypatch):
    layer = _linear()
    x = torch.randn(1, K).bfloat16()
    with torch.inference_mode():
        layer(x)
        forget()
        _no_lookup(monkeypatch)
        with pytest.raises(AssertionError, match="looked the kernel up"):
            layer(x)
