"""`activation_quant="int8"` through the modules: bitkern.Linear against the operator's reference (eager, compiled,
backward), the settings it refuses, quantize_model, bitkern.save / load, and the fusions (stacked q/k/v, SwiGLU, a
folded norm, the Inductor pass) keeping it."""

import copy

import pytest
import torch
from torch import nn

import bitkern
from bitkern.fusion import cost, install
from bitkern.ops import Matmul

pytestmark = pytest.mark.requires_avx2


def _linear(**settings) -> bitkern.Linear:
    torch.manual_seed(0)
    return bitkern.Linear(256, 96, bias=True, dtype="int4", group_size=64, **{"activation_quant": "int8", **settings})


def test_linear_computes_the_operator_with_quantized_activations():
    layer = _linear(compute_dtype=torch.bfloat16)
    x = torch.randn(2, 3, 256)
    y = layer(x)
    spec = Matmul.for_weight(layer.quantized_weight(), "bfloat16", bias=True, output_dtype="float32",
                             activation_quant="int8")
    reference = spec.reference(x.bfloat16(), layer.quantized_weight(), layer.bias)
    assert y.dtype == torch.float32 and torch.allclose(y, reference, rtol=1e-5, atol=1e-4)
    plain = copy.deepcopy(layer)
    plain.activation_quant = "none"
    assert not torch.equal(plain(x), y)  # the quantization shows
    assert torch.equal(torch.compile(layer, fullgraph=True)(x), y)
    assert "activation_quant='int8'" in repr(layer)


def test_gradients_pass_the_quantization_as_the_identity():
    layer, plain = _linear(), _linear(activation_quant="none")
    x = torch.randn(4, 256, requires_grad=True)
    layer(x).square().sum().backward()
    grad = x.grad.clone()
    x.grad = None
    (plain(x) + (layer(x) - plain(x)).detach()).square().sum().backward()
    assert torch.allclose(grad, x.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("settings, message", [(dict(dtype="float8_e4m3"), "integer weight codes"),
                                               (dict(group_size=16), "whole activation blocks"),
                                               (dict(activation_quant="fp8"), "accepted: \\['none', 'int8'\\]")])
def test_settings_the_operator_cannot_take_are_refused_before_any_kernel(settings, message):
    with pytest.raises(ValueError, match=message):
        bitkern.Linear(256, 96, **{"dtype": "int4", "activation_quant": "int8", **settings}, device="meta")
    layer = bitkern.Linear(256, 96, dtype="mxfp8", device="meta")
    with pytest.raises(ValueError, match="integer weight codes"):
        layer.activation_quant = "int8"
    assert layer.activation_quant == "none"
    with pytest.raises(ValueError, match="bitkern.Conv2d; accepted: \\['none'\\]"):
        bitkern.Conv2d(8, 16, 3, dtype="int4", group_size=-1, activation_quant="int8", device="meta")


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(32, 32, 3, padding=1)
        self.proj = nn.Linear(32, 64)
        self.lm_head = nn.Linear(64, 128, bias=False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, x):
        return self.lm_head(self.proj(self.conv(x).mean((2, 3))))


@pytest.mark.parametrize("output_layer, head_quant", [("auto", "none"), ("int8", "int8")])
def test_quantize_model_gives_it_to_the_linears_that_take_it(output_layer, head_quant, tmp_path):
    """Convolutions and an output layer kept in bfloat16 multiply x as it is; bitkern.save / load keep the setting."""
    net = _Net().to(torch.bfloat16)
    quantized = bitkern.quantize_model(copy.deepcopy(net), "int4", group_size=32, output_layer=output_layer,
                                       activation_quant="int8")
    assert quantized.conv.activation_quant == "none" and quantized.proj.activation_quant == "int8"
    assert quantized.lm_head.activation_quant == head_quant
    x = torch.randn(2, 32, 6, 6, dtype=torch.bfloat16)
    bitkern.save(quantized, tmp_path / "net.safetensors")
    loaded = bitkern.load(_Net().to(torch.bfloat16), tmp_path / "net.safetensors")
    assert loaded.proj.activation_quant == "int8" and loaded.lm_head.activation_quant == head_quant
    with torch.no_grad():
        assert torch.equal(loaded(x), quantized(x))


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(128, 256, bias=False), nn.Linear(128, 256, bias=False)
        self.down_proj, self.act_fn = nn.Linear(256, 128, bias=False), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """A Llama-style block: norm -> q/k/v, norm -> gate/up -> SwiGLU -> down."""

    def __init__(self):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.input_layernorm, self.post_attention_layernorm = LlamaRMSNorm(128), LlamaRMSNorm(128)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(128, 128), nn.Linear(128, 64), nn.Linear(128, 64)
        self.mlp = _MLP()

    def forward(self, x):
        h = self.input_layernorm(x)
        x = x + torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], -1)[..., :128]
        return x + self.mlp(self.post_attention_layernorm(x))


def test_fused_modules_keep_quantized_activations(monkeypatch):
    """Stacked q/k/v and gate/up, the SwiGLU epilogue and the norms folded into the prologues compute what the
    unfused layers compute (the same x̂ quantized the same way, up to a bf16 rounding of x̂ and float32 sums)."""
    torch.manual_seed(0)
    layer = _Layer().to(torch.bfloat16)
    for module in (layer.input_layernorm, layer.post_attention_layernorm):
        nn.init.normal_(module.weight, 1.0, 0.2)
    quantized = bitkern.quantize_model(layer, "int4", group_size=32, compute_dtype=torch.bfloat16,
                                       activation_quant="int8")
    monkeypatch.setattr(cost, "MIN_GAIN", 0.0)  # fuse every group: the test checks the fused modules, not the model
    fused = bitkern.fuse(copy.deepcopy(quantized))
    fused_layers = [m for m in fused.modules() if isinstance(m, bitkern.Linear)]
    assert len(fused_layers) == 3 and {m.activation_quant for m in fused_layers} == {"int8"}
    x = torch.randn(1, 5, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        expected, got = quantized(x).float(), fused(x).float()
    assert torch.allclose(got, expected, rtol=0.02, atol=0.02 * float(expected.abs().max()))


def test_the_inductor_pass_keeps_quantized_activations(monkeypatch):
    """The pass rewrites linear -> relu into linear_epilogue with the layer's activation quantization (compiled
    without the FX graph cache, which would hand back an earlier compile without running the pass)."""
    from torch._inductor import config

    monkeypatch.setattr(cost, "MIN_GAIN", 0.0)
    model = nn.Sequential(_linear(compute_dtype=torch.bfloat16), nn.ReLU())
    x = torch.randn(3, 256)
    with config.patch(fx_graph_cache=False, post_grad_custom_post_pass=None), torch.no_grad():
        fusion_pass = install()
        reference = model(x)
        y = torch.compile(model, fullgraph=True)(x)
    assert [(kind, fused) for kind, _, _, fused in fusion_pass.decisions] == [("relu", True)]
    assert torch.allclose(y, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))
