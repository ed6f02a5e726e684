"""bitkern.nn.dispatcher: ops whose plain calls are one Python call (the body, at the Autograd key), and whose
other calls (gradients, fake tensors, compile, inference mode) take torch's usual way with the same results."""

from typing import Optional

import pytest
import torch
from torch import Tensor

from bitkern.nn.dispatcher import op

CALLS = []  # (at the Autograd key?, grad mode) of each body run


@op("_test_scale")
def scale(x: Tensor, extra: list[Optional[Tensor]], factor: float = 2.0) -> Tensor:
    """y = factor · x (+ the extra tensors' sums)."""
    CALLS.append(not torch._C._dispatch_tls_is_dispatch_key_excluded(torch._C.DispatchKey.AutogradFunctionality))
    y = x * factor
    for tensor in extra:
        if tensor is not None:
            y = y + tensor.sum()
    return y


@scale.register_fake
def _scale_fake(x, extra, factor=2.0):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.factor = inputs[2]


def _backward(ctx, grad):
    return grad * ctx.factor, None, None


scale.register_autograd(_backward, setup_context=_setup)


@op("_test_no_gradient")
def no_gradient(x: Tensor) -> Tensor:
    return x + 1


@no_gradient.register_fake
def _no_gradient_fake(x):
    return torch.empty_like(x)


@pytest.fixture(autouse=True)
def calls():
    CALLS.clear()
    return CALLS


def test_a_plain_call_runs_the_body_once_at_the_autograd_key(calls):
    x = torch.randn(5)
    with torch.no_grad():
        y = torch.ops.bitkern._test_scale(x, [None, torch.ones(2)])
    assert torch.equal(y, x * 2 + 2) and calls == [True]
    calls.clear()
    y = torch.ops.bitkern._test_scale(x, [])  # grad mode on, nothing requires a gradient: plain too
    assert torch.equal(y, x * 2) and calls == [True]


def test_inference_mode_reaches_the_body_below_autograd(calls):
    x = torch.randn(5)
    with torch.inference_mode():
        y = torch.ops.bitkern._test_scale(x, [], 3.0)
    assert torch.equal(y, x * 3) and calls == [False]


@pytest.mark.parametrize("factor", [None, 0.5])
def test_gradients_go_through_the_formula_with_defaults_filled_in(calls, factor):
    x = torch.randn(5, requires_grad=True)
    arguments = (x, [torch.ones(1)]) if factor is None else (x, [torch.ones(1)], factor)
    y = torch.ops.bitkern._test_scale(*arguments)
    y.sum().backward()
    assert calls == [False]  # the formula's forward runs the body below autograd
    assert torch.equal(x.grad, torch.full((5,), 2.0 if factor is None else factor))


def test_an_op_without_a_formula_refuses_backward():
    x = torch.randn(3, requires_grad=True)
    y = torch.ops.bitkern._test_no_gradient(x)
    with pytest.raises(RuntimeError, match="_test_no_gradient has no gradient"):
        y.sum().backward()


def test_meta_and_fake_tensors_take_the_fake_implementation(calls):
    y = torch.ops.bitkern._test_scale(torch.empty(4, device="meta"), [])
    assert y.is_meta and y.shape == (4,) and calls == []
    compiled = torch.compile(lambda x: torch.ops.bitkern._test_scale(x, [None], 4.0) + 1, fullgraph=True,
                             backend="aot_eager")
    x = torch.randn(6, requires_grad=True)
    compiled(x).sum().backward()
    assert torch.equal(x.grad, torch.full((6,), 4.0))
    with torch.no_grad():
        assert torch.equal(compiled(x), x * 4 + 1)
