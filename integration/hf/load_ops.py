"""The conversion op transformers runs on each float weight of a layer that is quantized on load (imported
when a load needs it: transformers' loading module is not imported while transformers registers bitkern)."""

from __future__ import annotations

from torch import nn
from transformers.core_model_loading import ConversionOps


class QuantizeOnLoad(ConversionOps):
    """Given a converted nn.Linear's weight as it is read from the checkpoint, replace the (empty) layer by a
    bitkern.Linear quantized from it, so that the float weight is freed before the next tensor is read."""

    def __init__(self, hf_quantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict, *args, model=None, missing_keys=None, **kwargs) -> dict:
        from .quantizer import _replace, quantize_linear

        for key, value in input_dict.items():
            weight = value[0] if isinstance(value, list) else value
            name = key.rpartition(".")[0]
            module = model.get_submodule(name)
            module.weight = nn.Parameter(weight, requires_grad=False)
            _replace(model, name, quantize_linear(module, self.hf_quantizer.plan[name]))
            if missing_keys is not None:
                missing_keys.discard(key)
        return {}
