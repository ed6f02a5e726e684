"""The quantization method "bitkern" as vLLM sees it: a QuantizationConfig that gives every linear layer
bitkern's linear method.

vLLM pickles this config into its engine and worker processes, so the class lives at module level.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

from bitkern.nn.library import FLOAT_DTYPES

from .linear_method import BitkernLinearMethod
from .settings import Settings

METHOD = "bitkern"
SETTINGS_OVERRIDE = "quantization_config_dict_json"  # vLLM's hf_overrides key for a config not in the checkpoint
# CUDA kernels are built for sm_80 and newer (TensorCore mma m16n8k16 in bf16)
MIN_CUDA_CAPABILITY = 80


class BitkernVllmConfig(QuantizationConfig):
    """Quantize a float checkpoint's linear layers on load with bitkern (`settings`)."""

    def __init__(self, settings: Settings | None = None):
        super().__init__()
        self.settings = settings or Settings()

    def __repr__(self) -> str:
        return f"BitkernVllmConfig({self.settings.describe()})"

    def get_name(self) -> str:
        return METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return list(FLOAT_DTYPES)

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CUDA_CAPABILITY

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # the settings come from hf_overrides (or the defaults), never from a file of the model

    @classmethod
    def from_config_dict_json(cls, value) -> "BitkernVllmConfig":
        """`hf_overrides={"quantization_config_dict_json": "<JSON settings>"}` (read for float checkpoints)."""
        return cls(Settings.from_json(value))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "BitkernVllmConfig":
        """The checkpoint's own quantization_config, i.e. a checkpoint saved already quantized by bitkern."""
        raise ValueError(
            f"this checkpoint is already quantized with bitkern ({config}); vLLM cannot load pre-quantized bitkern "
            f"checkpoints yet. Serve the float checkpoint with quantization='bitkern' instead (it is quantized on load)")

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        """Called by vLLM for a checkpoint that is already quantized: refuse quantization='bitkern' on a
        checkpoint of another method with a message that says why (bitkern checkpoints need no override)."""
        method = hf_quant_cfg.get("quant_method")
        if user_quant != METHOD or method == METHOD:
            return None
        if hf_config is not None and hasattr(hf_config, SETTINGS_OVERRIDE):
            raise ValueError(f"bitkern settings were given in hf_overrides[{SETTINGS_OVERRIDE!r}], but this "
                             f"checkpoint is already quantized with {method!r}; bitkern quantizes float "
                             f"checkpoints on load")
        raise ValueError(f"quantization='bitkern' was given for a checkpoint quantized with {method!r}; bitkern "
                         f"serves float checkpoints (quantized on load). Leave out quantization= to serve it with "
                         f"vLLM's own {method!r} kernels")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None  # embeddings and the LM head stay float, as in bitkern.quantize_model(skip=["lm_head"])
        if is_layer_skipped(prefix, list(self.settings.modules_to_not_convert), self.packed_modules_mapping,
                            match_mode="suffix"):
            return UnquantizedLinearMethod()
        return BitkernLinearMethod(self.settings)
