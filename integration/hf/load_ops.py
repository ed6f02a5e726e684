"""The conversion op transformers runs on each float weight of a layer that is quantized on load (imported
when a load needs it: transformers' loading module is not imported while transformers registers bitkern)."""

from __future__ import annotations

from torch import nn
from transformers.core_model_loading import ConversionOps


class QuantizeOnLoad(ConversionOps):
    """Given a converted nn.Linear's weight as it is read from the checkpoint, replace the (empty) layer by a
    bitkern.Linear quantized from it, so that the float weight is freed before the next tensor is read; given an
    experts module's 3-D weight, quantize it for the quantizer to hold (`quantize_experts_weight`)."""

    def __init__(self, hf_quantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict, *args, model=None, missing_keys=None, **kwargs) -> dict:
        from .quantizer import _replace, quantize_linear

        for key, value in input_dict.items():
            weight = value[0] if isinstance(value, list) else value
            name, _, tensor = key.rpartition(".")
            if name in self.hf_quantizer.experts_plan:
                self.hf_quantizer.quantize_experts_weight(model, name, tensor, weight)
                if missing_keys is not None:
                    missing_keys.discard(key)
                continue
            module = model.get_submodule(name)
            module.weight = nn.Parameter(weight, requires_grad=False)
            _replace(model, name, quantize_linear(module, self.hf_quantizer.plan[name]))
            if missing_keys is not None:
                missing_keys.discard(key)
        return {}
