"""The dispatch layer: what calling a bitkern.ops spec runs.  ops attaches nothing itself; importing bitkern.cache
attaches the dispatch, whose hot path (a CPU call that passes the quick check) goes straight to the kernel lookup
for the host CPU."""

import torch

import bitkern
from bitkern.cache import dispatch
from bitkern.ops import Matmul, execution


def test_importing_bitkern_attaches_the_dispatch_to_ops():
    assert execution.run is dispatch.run


def test_calls_that_pass_the_quick_check_skip_the_full_check(monkeypatch):
    q = bitkern.quantize(torch.randn(32, 64), "int4", group_size=32)
    spec, packed = Matmul.for_weight(q, "bfloat16"), bitkern.pack(q)
    asked, checked = [], []
    monkeypatch.setattr(dispatch, "kernel_for", lambda *args: asked.append(args) or (lambda x, w, b: x.float() @ torch.ones(64, 32)))
    monkeypatch.setattr(Matmul, "check_inputs", lambda self, *args: checked.append(args))
    x = torch.randn(3, 64).bfloat16()
    spec(x, packed)
    assert asked[-1] == (spec, 32, 64, 3, "tile16", None) and not checked
    spec(torch.nn.Parameter(x, requires_grad=False), packed)  # a Tensor subclass: the full check runs
    assert len(checked) == 1 and asked[-1] == (spec, 32, 64, 3, "tile16", None)
