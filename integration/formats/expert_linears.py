"""Mixture-of-experts checkpoints that store every expert's projections as linear layers of their own, gathered into
one `ImportedExperts` per experts module, as transformers 5's experts modules (`Qwen3MoeExperts`, `MixtralExperts`)
hold them.

GPTQModel quantizes a Qwen3-MoE or Mixtral model one expert linear layer at a time and writes, per experts module P
(e.g. "model.layers.0.mlp.experts") and expert e, `P.e.gate_proj.*`, `P.e.up_proj.*` and `P.e.down_proj.*` (for GPTQ:
qweight, qzeros, scales, g_idx).  bitkern's experts take, per expert, the gate/up projection [2·intermediate, hidden]
as the gate's rows then the up's (the halves the model's `_apply_gate` splits) and the down projection
[hidden, intermediate]; rows stack exactly (codes, scales and zeros are per row), so the dequantized weights stay the
checkpoint's own, bit for bit.

Checkpoints of transformers 4 name the layers otherwise (Mixtral's `P.e.w1`, `w3`, `w2`); transformers' own
conversion mapping for the model type says which is which (`checkpoint_names`), and errors name the tensors as the
checkpoint does.

Act-order layers (each expert's input columns in an order of its own) are refused: bitkern's grouped kernels read
every expert's input in one order.
"""

from __future__ import annotations

import re

import torch

from bitkern.ttype import QuantizedWeight

from .checkpoint_names import STACKED, CheckpointNames
from .imported import FormatError, ImportedExperts, ImportedLinear

EXPERT_LINEAR = re.compile(r"(?P<module>.+\.experts)\.(?P<expert>\d+)\.(?P<layer>\w+)")


def experts_of(names, checkpoint_names: CheckpointNames = CheckpointNames()) -> dict[str, dict[tuple[int, str], str]]:
    """{experts module: {(expert, gate_proj / up_proj / down_proj): linear layer name}} of the expert linear layers
    among module `names` (named as `checkpoint_names` says)."""
    found = {}
    for name in names:
        match = EXPERT_LINEAR.fullmatch(name)
        layer = checkpoint_names.expert_layer(match["layer"]) if match else None
        if layer in STACKED["gate_up"] + STACKED["down"]:
            found.setdefault(match["module"], {})[int(match["expert"]), layer] = name
    return found


def gather_experts(modules: dict, first_tensor: str, checkpoint_names: CheckpointNames = CheckpointNames()) -> dict:
    """`modules` ({name: ImportedLinear or ImportedExperts}) with each experts module's expert linear layers replaced
    by one ImportedExperts under the experts module's name; `first_tensor` (e.g. "qweight") names a layer's tensors
    in errors; `checkpoint_names`: how the checkpoint names the layers."""
    gathered = dict(modules)
    for module, layers in experts_of(modules, checkpoint_names).items():
        gathered[module] = stack_experts(module, {key: (name, gathered.pop(name)) for key, name in layers.items()},
                                         first_tensor)
    return gathered


def stack_experts(module: str, layers: dict, first_tensor: str) -> ImportedExperts:
    """The ImportedExperts of experts module `module` from its expert linear layers ({(expert, gate_proj / up_proj /
    down_proj): (the checkpoint's name of the layer, its ImportedLinear)}): each expert's gate and up rows stacked,
    every expert of one format (what bitkern.load_pretrained and the vLLM plugin both run); FormatError naming the
    tensor at fault (a missing layer, act-order, formats that differ)."""
    experts = 1 + max(expert for expert, _ in layers)
    stored = {layer: name.rpartition(".")[2] for (_, layer), (name, _) in layers.items()}
    for expert in range(experts):
        for projection in STACKED["gate_up"] + STACKED["down"]:
            if (expert, projection) not in layers:
                tensor = f"{module}.{expert}.{stored.get(projection, projection)}.{first_tensor}"
                raise FormatError(f"tensor {tensor!r} is missing from the checkpoint: experts module {module!r} "
                                  f"holds {experts} experts quantized, each needs "
                                  f"{', '.join(stored.get(layer, layer) for layer in STACKED['gate_up'])} and "
                                  f"{stored.get('down_proj', 'down_proj')}")
    weights, biases = {}, {}
    for name, projections in STACKED.items():
        stacked = [_stack([layers[expert, p] for p in projections], first_tensor) for expert in range(experts)]
        first_name = layers[0, projections[0]][0]
        for expert, (weight, _) in enumerate(stacked):
            _check_like(weight, stacked[0][0], f"{layers[expert, projections[0]][0]}.{first_tensor}", first_name)
        weights[name] = [weight for weight, _ in stacked]
        biases[name] = _stacked_bias([(layers[expert, projections[0]][0], bias)
                                      for expert, (_, bias) in enumerate(stacked)])
    return ImportedExperts(weights, biases)


def _stack(layers: list[tuple[str, ImportedLinear]], first_tensor: str) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """One expert's (weight, bias) of a projection: its linear layers' rows one after the other."""
    for name, layer in layers:
        if not isinstance(layer, ImportedLinear):
            raise FormatError(f"tensor {f'{name}.{first_tensor}'!r}: {name!r} is not a linear layer")
        if layer.input_order is not None:
            raise FormatError(f"tensor {name + '.g_idx'!r} orders the layer's inputs by activation (act-order, "
                              f"desc_act=True): every expert's inputs in an order of its own, which bitkern's grouped "
                              f"experts kernels do not take; quantize the experts with desc_act=False")
    first_name, first = layers[0]
    for name, layer in layers[1:]:
        _check_like(layer.weight, first.weight, f"{name}.{first_tensor}", first_name, rows=False)
    parts = [layer.weight for _, layer in layers]
    if any(part.tensor_scale is not None for part in parts):
        raise FormatError(f"tensor {f'{first_name}.{first_tensor}'!r} has a per-tensor scale: expert layers of "
                          f"{parts[0].ttype.name} cannot be stacked")
    weight = QuantizedWeight(parts[0].ttype, (sum(part.shape[0] for part in parts), parts[0].shape[1]),
                             parts[0].group_size, parts[0].zero_mode, torch.cat([part.qweight for part in parts]),
                             torch.cat([part.scales for part in parts]),
                             None if parts[0].zeros is None else torch.cat([part.zeros for part in parts]))
    with_bias = [layer.bias is not None for _, layer in layers]
    if any(with_bias) and not all(with_bias):
        raise FormatError(f"tensor {layers[with_bias.index(False)][0] + '.bias'!r} is missing: "
                          f"{layers[with_bias.index(True)][0]!r} of the same expert has a bias")
    return weight, torch.cat([layer.bias for _, layer in layers]) if all(with_bias) else None


def _check_like(weight: QuantizedWeight, first: QuantizedWeight, tensor_name: str, other: str,
                rows: bool = True) -> None:
    """FormatError naming `tensor_name` unless `weight` has `first`'s type, group size, zero mode, scale dtype and
    inputs (and rows, if `rows`)."""
    def form(w: QuantizedWeight) -> tuple:
        return (w.ttype.name, w.shape if rows else w.shape[1], w.group_size, w.zero_mode, w.scales.dtype)

    if form(weight) != form(first):
        raise FormatError(f"tensor {tensor_name!r} holds a {weight.ttype.name} [out, in] = {list(weight.shape)} layer "
                          f"(group size {weight.group_size}, zero mode {weight.zero_mode}, {weight.scales.dtype} "
                          f"scales), unlike {other!r}'s {first.ttype.name} {list(first.shape)} (group size "
                          f"{first.group_size}, zero mode {first.zero_mode}, {first.scales.dtype} scales): the experts "
                          f"of one module must share one format")


def _stacked_bias(biases: list[tuple[str, torch.Tensor | None]]) -> torch.Tensor | None:
    """The [E, N] bias of a projection's experts, None if none has one."""
    present = [bias is not None for _, bias in biases]
    if not any(present):
        return None
    if not all(present):
        raise FormatError(f"tensor {biases[present.index(False)][0] + '.bias'!r} is missing: "
                          f"{biases[present.index(True)][0]!r} of another expert has a bias")
    return torch.stack([bias for _, bias in biases])
