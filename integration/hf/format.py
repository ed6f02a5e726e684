"""The checkpoint format of bitkern models saved with transformers' `save_pretrained` (read back by
`from_pretrained` after `import bitkern`, or by `bitkern.load_pretrained`).  This module needs no transformers.

config.json, "quantization_config" (`BitkernConfig.to_dict()`):
    quant_method "bitkern"; format "bitkern.hf/1"; source: the format of the checkpoint's tensors ("bitkern");
    dtype, group_size, zero_mode, scale_dtype, compute_dtype, activation_quant, method: the settings of every
    converted nn.Linear (activation_quant absent: "none"; method, how its scales and zeros were chosen, absent:
    "rtn"; loading reads the tensors as stored and never re-runs it);
    overrides {pattern: {setting: value}}: other settings for the modules a pattern matches (the first
    matching pattern wins); modules_to_not_convert: the modules left float (`BitkernConfig.converts` says
    how names match).
Per converted nn.Linear `m` with weight [N, K] (N = out_features, K = in_features), b bits per code, g its
group size (K for per-channel), all in bitkern's portable layout (`bitkern.QuantizedWeight`):
    m.weight               int32 [N, ceil(K / (32 // b))]: codes packed along K, little-endian, code i of a
                           word in bits [i·b, (i+1)·b) (widths that do not divide 32 leave the top bits zero)
    m.weight_scale         [N, K / g] in the scale dtype (float16, bfloat16, float32); uint8 codes of the block
                           scale for block-scaled types (mxfp4, mxfp8: e8m0; nvfp4: e4m3)
    m.weight_zero          [N, K / g]: uint8 zero points (zero_mode "gptq", "awq") or the scale dtype ("hqq");
                           absent for zero_mode "none"
    m.weight_tensor_scale  float32 []: nvfp4's per-tensor scale; absent otherwise
    m.bias                 as nn.Linear stores it
Per quantized mixture-of-experts experts module `e` (a transformers experts module, stored as a `bitkern.Experts`)
with E experts, its projections `e.gate_up` (or `e.up` where the experts have no gate) and `e.down`, each the same
tensors as a Linear's with a leading expert dimension: `e.gate_up.weight` int32 [E, N, ceil(K / (32 // b))],
`e.gate_up.weight_scale` [E, N, K / g], `e.gate_up.weight_zero`, `e.gate_up.weight_tensor_scale` [E], and
`e.gate_up.bias` [E, N] where the model's experts have biases.  N and K are those of one expert's projection as a
matrix (gate_up: N = 2 × intermediate size, K = hidden size, in the order of the model's gate/up outputs;
down: N = hidden size, K = intermediate size), whichever way the model stores its 3-D parameters.  The settings
of a projection are those the config gives the name `e.gate_up_proj` (`e.up_proj`) or `e.down_proj`, the float
model's parameter names.
The weight is v(q)·s for zero_mode "none" (v: the type's value of code q; block types: s = block scale ×
tensor scale) and (q − z)·s otherwise (`QuantizedWeight.dequantize`).  The codes are named `weight` and
are not [N, K], so a transformers without bitkern registered fails loading them (a size mismatch) instead of
leaving the layer's weight random.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import Linear, QuantizedWeight
from ...nn.experts import ExpertWeights

FORMAT = "bitkern.hf/1"
# QuantizedWeight field -> tensor name in the checkpoint, relative to the module
TENSOR_NAMES = {"qweight": "weight", "scales": "weight_scale", "zeros": "weight_zero",
                "tensor_scale": "weight_tensor_scale"}
SETTINGS = ("dtype", "group_size", "zero_mode", "scale_dtype", "compute_dtype", "activation_quant", "method")


@dataclass(frozen=True)
class LayerSettings:
    """How one Linear is quantized: a bitkern type name, group size (None: the type's default, -1: per
    channel), zero mode (None: the type's default), scale dtype and compute dtype (names of torch dtypes;
    compute_dtype None: the input's), activation quantization (`bitkern.Linear`'s)."""

    dtype: str = "nf4"
    group_size: int | None = None
    zero_mode: str | None = None
    scale_dtype: str = "float16"
    compute_dtype: str | None = None
    activation_quant: str = "none"
    method: str = "rtn"

    def layer(self, in_features: int, out_features: int, bias: bool = False) -> Linear:
        """An empty bitkern.Linear with these settings on the meta device (ValueError naming the setting
        that does not fit this shape)."""
        return Linear(in_features, out_features, bias, self.dtype, self.group_size, self.zero_mode,
                      self.compute_dtype, device="meta", scale_dtype=self.scale_dtype,
                      activation_quant=self.activation_quant, method=self.method)


def checkpoint_tensors(layer: Linear) -> dict[str, torch.Tensor]:
    """A quantized Linear's weight as the checkpoint stores it, named relative to the module (no bias)."""
    weight = layer.quantized_weight()
    return {name: getattr(weight, field) for field, name in TENSOR_NAMES.items() if getattr(weight, field) is not None}


def expected_tensors(settings: LayerSettings, in_features: int, out_features: int) -> dict[str, tuple]:
    """{name: (shape, dtype)} of the tensors `checkpoint_tensors` gives for a Linear of this shape."""
    return {name: (tuple(t.shape), t.dtype)
            for name, t in checkpoint_tensors(settings.layer(in_features, out_features)).items()}


def misfits(found: dict[str, tuple], settings: LayerSettings, in_features: int, out_features: int) -> list[str]:
    """What keeps tensors of these {name: (shape, dtype)} from being a Linear of this shape and settings."""
    return compare(found, expected_tensors(settings, in_features, out_features), settings.dtype)


def compare(found: dict[str, tuple], expected: dict[str, tuple], dtype: str) -> list[str]:
    """What keeps tensors of these {name: (shape, dtype)} from being the `expected` ones (of a `dtype` weight)."""
    problems = []
    for name in sorted(set(expected) | set(found)):
        if name not in found:
            problems.append(f"{name} is missing")
        elif name not in expected:
            problems.append(f"{name} is not a tensor of a {dtype} weight")
        elif tuple(found[name]) != expected[name]:
            problems.append(f"{name} is {_describe(found[name])}, expected {_describe(expected[name])}")
    return problems


def linear_from_checkpoint(tensors: dict[str, torch.Tensor], settings: LayerSettings, in_features: int,
                           out_features: int, bias: torch.Tensor | None = None) -> Linear:
    """The bitkern.Linear that a checkpoint's tensors (named as `checkpoint_tensors` names them, on any
    device) describe, for a Linear [out_features, in_features] quantized with `settings`: every pre-quantized
    load goes through here.  ValueError naming each tensor whose name, shape or dtype does not fit."""
    problems = misfits({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}, settings, in_features,
                       out_features)
    if problems:
        raise ValueError(f"the checkpoint's tensors do not fit a Linear({in_features}, {out_features}) quantized "
                         f"with {settings}: {'; '.join(problems)}")
    layout = settings.layer(in_features, out_features)
    weight = QuantizedWeight(layout.weight_dtype, (out_features, in_features), layout.group_size, layout.zero_mode,
                             *(tensors.get(name) for name in TENSOR_NAMES.values()))
    return Linear.from_quantized(weight, bias, compute_dtype=settings.compute_dtype,
                                 activation_quant=settings.activation_quant, method=settings.method)


def experts_checkpoint_tensors(projection: ExpertWeights) -> dict[str, torch.Tensor]:
    """A quantized experts projection's weights as the checkpoint stores them (each a Linear's, stacked), named
    relative to the module (no bias)."""
    weights = projection.quantized_weights()
    return {name: torch.stack([getattr(weight, field) for weight in weights]) for field, name in TENSOR_NAMES.items()
            if getattr(weights[0], field) is not None}


def expected_experts_tensors(settings: LayerSettings, num_experts: int, in_features: int,
                             out_features: int) -> dict[str, tuple]:
    """{name: (shape, dtype)} of the tensors `experts_checkpoint_tensors` gives for these experts."""
    return {name: ((num_experts, *shape), dtype)
            for name, (shape, dtype) in expected_tensors(settings, in_features, out_features).items()}


def experts_from_checkpoint(tensors: dict[str, torch.Tensor], settings: LayerSettings, num_experts: int,
                            in_features: int, out_features: int, bias: torch.Tensor | None = None) -> ExpertWeights:
    """The experts projection that a checkpoint's tensors (named as `experts_checkpoint_tensors` names them)
    describe; ValueError naming each tensor whose name, shape or dtype does not fit."""
    problems = compare({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()},
                       expected_experts_tensors(settings, num_experts, in_features, out_features), settings.dtype)
    if problems:
        raise ValueError(f"the checkpoint's tensors do not fit {num_experts} experts' [{out_features}, {in_features}] "
                         f"weights quantized with {settings}: {'; '.join(problems)}")
    layout = settings.layer(in_features, out_features)
    weights = [QuantizedWeight(layout.weight_dtype, (out_features, in_features), layout.group_size, layout.zero_mode,
                               *(None if tensors.get(name) is None else tensors[name][expert]
                                 for name in TENSOR_NAMES.values())) for expert in range(num_experts)]
    return ExpertWeights.from_quantized(weights, bias, compute_dtype=settings.compute_dtype,
                                        activation_quant=settings.activation_quant, method=settings.method)


def _describe(shape_and_dtype: tuple) -> str:
    shape, dtype = shape_and_dtype
    return f"{list(shape)} {str(dtype).removeprefix('torch.')}"
