"""bitkern.fuse and bitkern.fusion.explain on a small Hugging Face Llama and on plain modules: the fused model
computes what the unfused one did (the kernels' error bounds: same sums, fewer calls), with fewer kernel calls;
repeated layers are priced once; a failed fuse leaves the model as it was; gradients reach the input;
torch.compile traces a fused MLP in one graph."""

import copy

import pytest
import torch
from torch import nn

import bitkern
from bitkern.fusion import explain, plan
from bitkern.fusion.modules import EpilogueLinear, StackedOutput, SwiGLUMLP


@pytest.fixture(scope="module")
def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    bitkern.quantize_model(model, "int4", group_size=64, compute_dtype=torch.bfloat16, skip=["lm_head"])
    return model


def _kernel_calls(model, *inputs) -> int:
    """bitkern op calls in one forward pass (counted through torch's dispatcher)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "bitkern":
                Count.calls += 1
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        model(*inputs)
    return Count.calls


def test_fused_llama_computes_the_same_logits_with_fewer_kernel_calls(llama, monkeypatch):
    model = copy.deepcopy(llama)
    tokens = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(tokens).logits
    calls_before = _kernel_calls(model, tokens)
    report = explain(model, tokens)
    kinds = sorted((g.path, g.kind) for g in report.groups if g.kind != "norm")
    assert kinds == [("model.layers.0.mlp", "swiglu"), ("model.layers.0.self_attn", "qkv"),
                     ("model.layers.1.mlp", "swiglu"), ("model.layers.1.self_attn", "qkv")]
    # a float32 model computing in bfloat16: its norms are reported, not folded (tests/fusion/test_norm_fusion.py)
    norms = [g for g in report.groups if g.kind == "norm"]
    assert len(norms) == 4 and all("layers compute in torch.bfloat16" in g.reason for g in norms)
    assert sum("decision reused" in " ".join(g.notes) for g in report.groups) == 2  # layer 1 priced as layer 0
    assert "modeled gain" in str(report) and "model.layers.1.mlp" in str(report)
    assert all(g.decision.measured is not None for g in report.groups if g.kind != "norm")
    monkeypatch.setattr(plan.Decision, "fuse", property(lambda self: True))  # whatever this machine's timings say
    bitkern.fuse(model, tokens)
    with torch.no_grad():
        logits = model(tokens).logits
    # the stacked kernels compute every output with the same sums as the separate ones
    assert torch.allclose(logits, reference, atol=1e-3 * float(reference.abs().max()))
    assert _kernel_calls(model, tokens) == calls_before - 2 * (2 + 1)  # per layer: q/k/v 3 -> 1, gate/up 2 -> 1


def test_fuse_rewrites_every_pattern_and_keeps_gradients(monkeypatch):
    torch.manual_seed(0)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(64, 96, bias=False), nn.Linear(64, 96, bias=False)
            self.down_proj, self.act_fn = nn.Linear(96, 64), nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = nn.Linear(64, 64), nn.Linear(64, 32), nn.Linear(64, 32)
            self.mlp = MLP()
            self.head = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))

        def forward(self, x):
            return self.head(self.mlp(x) + self.q_proj(x) + torch.cat([self.k_proj(x), self.v_proj(x)], -1))

    model = bitkern.quantize_model(Block(), "nf4", group_size=32, compute_dtype=torch.bfloat16)
    x = torch.randn(3, 64)
    with torch.no_grad():
        reference = model(x)
    groups = bitkern.fusion.candidates(model)
    assert sorted(g.kind for g in groups) == ["act", "qkv", "swiglu"]
    monkeypatch.setattr(plan.Decision, "fuse", property(lambda self: True))  # every rewrite, whatever the timings
    bitkern.fuse(model)
    assert isinstance(model.q_proj, StackedOutput) and isinstance(model.mlp, SwiGLUMLP)
    assert isinstance(model.head[0], EpilogueLinear) and isinstance(model.head[1], nn.Identity)
    x = x.clone().requires_grad_(True)
    y = model(x)
    assert torch.allclose(y, reference, atol=1e-4 * float(reference.abs().max()))
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_a_failed_fuse_leaves_the_model_unchanged(monkeypatch):
    model = nn.Module()
    model.attn = nn.Module()
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(model.attn, name, bitkern.Linear(64, 32, dtype="int4", group_size=32))
    model.seq = nn.Sequential(bitkern.Linear(64, 64, dtype="int4", group_size=32), nn.GELU())
    before = {name: id(module) for name, module in model.named_modules()}

    def broken(self):
        if self.kind == "act":
            raise RuntimeError("out of memory")
        return original(self)

    original = plan.Candidate.build
    monkeypatch.setattr(plan.Candidate, "build", broken)
    monkeypatch.setattr(plan.Decision, "fuse", property(lambda self: True))
    monkeypatch.setattr(plan, "decide", lambda *args: plan.Decision((2.0, 1.0)))
    with pytest.raises(RuntimeError, match="out of memory"):
        bitkern.fuse(model)
    assert {name: id(module) for name, module in model.named_modules()} == before


def test_groups_that_cannot_be_stacked_are_reported_not_fused():
    model = nn.Module()
    model.q_proj = bitkern.Linear(64, 32, dtype="int4", group_size=32)
    model.k_proj = bitkern.Linear(64, 32, dtype="nf4", group_size=32)
    model.v_proj = bitkern.Linear(64, 32, dtype="int4", group_size=32)
    report = explain(model)
    assert report.groups[0].reason == "layers with different weight_dtype"
    assert "not fusable" in str(report)
    bitkern.fuse(model)
    assert isinstance(model.q_proj, bitkern.Linear)


def test_fused_mlp_compiles_fullgraph():
    gate, up = bitkern.Linear(64, 96, False, "int4", 32), bitkern.Linear(64, 96, False, "int4", 32)
    mlp = SwiGLUMLP(gate, up, bitkern.Linear(96, 64, True, "int4", 32))
    x = torch.randn(2, 64)
    compiled = torch.compile(mlp, fullgraph=True)
    with torch.no_grad():
        assert torch.allclose(compiled(x), mlp(x))
