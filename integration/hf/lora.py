"""LoRA adapters (PEFT) on bitkern layers: the frozen quantized base plus trainable low-rank matrices.

PEFT dispatches layer types it does not know to the classes a LoraConfig registers:

    from peft import LoraConfig, get_peft_model
    from bitkern.integration.hf.lora import LoraLinear

    config = LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    config._register_custom_module({bitkern.Linear: LoraLinear})
    model = get_peft_model(model, config)   # train: only the adapters get gradients
"""

from __future__ import annotations

import torch
from peft.tuners.lora import LoraLayer


class LoraLinear(torch.nn.Module, LoraLayer):
    """y = base(x) + B(A(dropout(x))) · scaling for a bitkern.Linear base; the adapters cannot be merged into
    the quantized weight (dequantize the model for that)."""

    def __init__(self, base_layer, adapter_name: str, config, r: int = 0, lora_alpha: int = 1, **kwargs):
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        if config.use_dora:
            raise ValueError("LoRA on bitkern layers supports plain LoRA; use_dora=True is not supported")
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        result = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters:
            return result
        for adapter in self.active_adapters:
            if adapter not in self.lora_A:
                continue
            lora_a, lora_b = self.lora_A[adapter], self.lora_B[adapter]
            update = lora_b(lora_a(self.lora_dropout[adapter](self._cast_input_dtype(x, lora_a.weight.dtype))))
            result = result + (update * self.scaling[adapter]).to(result.dtype)
        return result

    def __repr__(self) -> str:
        return "lora." + super().__repr__()
