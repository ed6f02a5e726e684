"""The Inductor post-grad pass: a residual add and an activation after a bitkern linear become one
linear_epilogue call where the cost model fuses (same results within the kernels' rounding), are left alone where
it does not, and a user's own post-grad pass stays installed; a norm `bitkern.fuse` folded into a kernel's prologue
is computed by Inductor instead where the compiled baseline wins."""

import copy

import pytest
import torch
from torch import nn

import bitkern
from bitkern.fusion import FusionPass, install
from bitkern.fusion import cost, plan
from bitkern.fusion.cost import Decision
from bitkern.fusion.inductor import _arguments, epilogue_kernel_calls
from bitkern.fusion.modules import FoldedNorm
from bitkern.fusion.stack import swiglu_ordered, unstack_swiglu


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = bitkern.Linear(64, 128, True, "int4", 32, compute_dtype=torch.bfloat16)
        self.down = bitkern.Linear(128, 64, True, "int4", 32, compute_dtype=torch.bfloat16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + x


@pytest.fixture(autouse=True)
def custom_passes():
    """Inductor's post-grad custom passes as each test sets them, put back after it by the config's own patch
    (pytest's monkeypatch, from 9.2, deletes such a config entry on undo: it is not in the module's __dict__)."""
    with torch._inductor.config.patch(post_grad_custom_post_pass=None):
        yield


def _ops(graph_calls: list) -> list:
    return [str(node.target) for graph in graph_calls for node in graph.nodes if node.op == "call_function"]


def test_pass_folds_activation_and_residual_into_the_kernels(monkeypatch):
    fusion_pass = install()
    seen = []

    def record(graph):
        seen.append(graph)

    torch._inductor.config.post_grad_custom_post_pass = [*torch._inductor.config.post_grad_custom_post_pass, record]
    # the relu fold's modeled gain (~1.02 here) sits at the margin and moves with the measured bandwidth: fuse
    # everything, so that the test checks the rewrite, not the machine (the next test checks rejections)
    monkeypatch.setattr(cost, "MIN_GAIN", 0.0)
    model = Block()
    x = torch.randn(4, 64)
    with torch.no_grad():
        reference = model(x)
        compiled = torch.compile(model, fullgraph=True)
        y = compiled(x)
    ops = _ops(seen)
    assert ops.count("bitkern.linear_epilogue.default") == 2 and "bitkern.linear.default" not in ops
    assert [(kind, fused) for kind, _, _, fused in fusion_pass.decisions] == [("relu", True), ("residual", True)]
    assert torch.allclose(y, reference, atol=1e-4 * float(reference.abs().max()))
    calls = epilogue_kernel_calls(seen[-1])  # what an engine running the graph makes ready (vLLM's pass)
    assert sorted((call.spec.epilogue, call.spec.residual, call.n, call.k) for call in calls) == \
        [("none", True, 64, 128), ("relu", False, 128, 64)]


def test_pass_keeps_what_the_cost_model_rejects_and_user_passes_stay(monkeypatch):
    def users_pass(graph):
        users_pass.calls += 1

    users_pass.calls = 0
    torch._inductor.config.post_grad_custom_post_pass = users_pass
    fusion_pass = install()
    assert torch._inductor.config.post_grad_custom_post_pass == [users_pass, fusion_pass]
    assert install() is fusion_pass  # installed once
    monkeypatch.setattr(cost, "MIN_GAIN", 1e9)  # nothing wins
    model = Block()
    x = torch.randn(2, 64)
    with torch.no_grad():
        torch.compile(model, fullgraph=True)(x)
    assert users_pass.calls >= 1 and fusion_pass.decisions and not any(f for *_, f in fusion_pass.decisions)
    assert isinstance(fusion_pass, FusionPass)


class SwiGLUBlock(nn.Module):
    """vLLM's MLP as the plugin serves it: gate/up as one layer in SwiGLU row order whose output is read back in
    [gate; up] order, SiluAndMul's silu(first half) · second half, then down."""

    def __init__(self):
        super().__init__()
        gate_up = bitkern.Linear(64, 2 * 48, False, "int4", 32, compute_dtype=torch.bfloat16)
        self.gate_up = swiglu_ordered(gate_up)
        self.down = bitkern.Linear(48, 64, False, "int4", 16, compute_dtype=torch.bfloat16)

    def forward(self, x):
        y = unstack_swiglu(self.gate_up(x))
        half = y.shape[-1] // 2
        return self.down(torch.nn.functional.silu(y[..., :half]) * y[..., half:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pass_folds_swiglu_of_a_reordered_gate_up_layer_for_every_row_count(monkeypatch, dtype):
    """The graph is traced with dynamic rows: the decision is made at one row and at the traced count, and the
    compiled graphs compute what the eager block does at 1, 16 and 128 rows (bfloat16: Inductor's silu runs in
    float32 between two conversions, the kernel's too)."""
    fusion_pass = install()
    seen = []
    config = torch._inductor.config
    config.post_grad_custom_post_pass = [*config.post_grad_custom_post_pass, seen.append]
    monkeypatch.setattr(cost, "MIN_GAIN", 0.0)
    model = SwiGLUBlock()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for m in (16, 1, 128):
            x = torch.randn(m, 64, dtype=dtype)
            reference = model(x).float()
            y = compiled(x).float()
            assert torch.allclose(y, reference, atol=2e-2 * float(reference.abs().max())), m
    ops = _ops(seen)  # two graphs: dynamic rows, and one row (which torch.compile specializes)
    assert ops.count("bitkern.linear_epilogue.default") == ops.count("bitkern.linear.default") == len(seen) == 2
    assert not {"aten.permute.default", "aten.exp.default", "aten.slice.Tensor"} & set(ops)
    assert sorted((kind, rows, fused) for kind, rows, _, fused in fusion_pass.decisions) == [
        ("swiglu", (1,), True), ("swiglu", (1, 16), True)]


def test_swiglu_ordered_layer_unstacks_to_the_stacked_output():
    layer = bitkern.Linear(64, 64, True, "nf4", 32)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(unstack_swiglu(swiglu_ordered(layer)(x)), layer(x))


class NormAfterAdd(nn.Module):
    """A residual add, then a norm before two bitkern Linears that `bitkern.fuse` folds it into (each kernel
    normalizes x in its prologue)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.seq = nn.Sequential(norm, bitkern.Linear(64, 96, False, "int4", 32, compute_dtype=torch.bfloat16))
        self.other = nn.Sequential(copy.deepcopy(norm), bitkern.Linear(64, 32, False, "int4", 32,
                                                                       compute_dtype=torch.bfloat16))

    def forward(self, x, residual):
        h = x + residual
        return self.seq(h), self.other(h)


def _norms_in(graph_calls: list) -> list:
    """The norm argument of every linear_epilogue call in the graphs the pass left."""
    found = []
    for graph in graph_calls:
        for node in graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.bitkern.linear_epilogue.default:
                found.append(_arguments(node)["norm"])
    return found


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("rows", [1, 16])
def test_pass_unfolds_a_norm_that_inductor_computes_for_less(norm, rows, monkeypatch):
    """The norm's input comes from a pointwise add, which Inductor fuses the unfused norm into: the prologue has
    nothing to save there, so the pass computes x̂ in the graph and the kernels run without their norm; with
    `always` the folded norm stays.  Both give the unfused model's outputs within the kernels' rounding."""
    torch.manual_seed(0)
    module = nn.RMSNorm(64, eps=1e-6) if norm == "rmsnorm" else nn.LayerNorm(64)
    with torch.no_grad():
        module.weight.copy_(1 + 0.3 * torch.randn(64))
    model = NormAfterAdd(module).to(torch.bfloat16)
    x, residual = (torch.randn(rows, 64, dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        reference = model(x, residual)
    monkeypatch.setattr(plan, "decide", lambda unfused, fused, m, *runners: Decision((2.0, 1.0)))
    bitkern.fuse(model, x, residual)
    assert isinstance(model.seq[0], FoldedNorm) and isinstance(model.other[0], FoldedNorm)
    kind = "torch_rmsnorm" if norm == "rmsnorm" else "layernorm"
    for always, expected in ((False, ["none", "none"]), (True, [kind, kind])):
        seen, fusion_pass = [], FusionPass(always=always)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, options={"post_grad_custom_post_pass": [fusion_pass,
                                                                                                  seen.append]})
        with torch.no_grad():
            outputs = compiled(x, residual)
        assert _norms_in(seen) == expected
        norm_decisions = [d for d in fusion_pass.decisions if d[0] == "norm"]
        assert len(norm_decisions) == 2 and all(gain < cost.MIN_GAIN for _, _, gain, _ in norm_decisions)
        assert all(kept == always for *_, kept in norm_decisions)
        for y, y_reference in zip(outputs, reference):
            scale = float(y_reference.float().abs().max())
            assert float((y.float() - y_reference.float()).abs().max()) <= 2e-2 * scale


def test_the_pass_keys_inductors_cache_by_bitkern_op_schemas(monkeypatch):
    """A graph compiled with the C++ wrapper calls bitkern's ops by the schemas it was compiled against: Inductor's
    cache (keyed by the pass's uuid) must not hand a graph compiled against other schemas (an older bitkern) to this
    one.  Seen: grouped_linear gaining activation_quant made a cached graph's C++ wrapper crash the process."""
    from bitkern.nn import dispatcher

    assert "grouped_linear(Tensor x, Tensor?[] weight" in dispatcher.schemas()
    key = FusionPass().uuid()
    assert FusionPass().uuid() == key
    older = dispatcher.SCHEMAS["grouped_linear"].replace(', str activation_quant="none"', "")
    assert older != dispatcher.SCHEMAS["grouped_linear"]
    monkeypatch.setitem(dispatcher.SCHEMAS, "grouped_linear", older)
    assert FusionPass().uuid() != key
