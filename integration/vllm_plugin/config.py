"""The quantization method "bitkern" as vLLM sees it: a QuantizationConfig that gives every linear layer
bitkern's linear method: quantize a float checkpoint on load (`Settings`), load a bitkern checkpoint
(save_pretrained of a model quantized with bitkern.BitkernConfig) as stored, or serve a GPTQ, AWQ or
bitsandbytes 4-bit checkpoint, or gpt-oss's MXFP4 experts, converted on load into bitkern layers (`sources.py`).

Serving a GPTQ, AWQ, bitsandbytes or gpt-oss MXFP4 checkpoint on bitkern's kernels is the user's choice,
`quantization="bitkern"` (`--quantization bitkern`); without it vLLM serves the checkpoint with its own method.

vLLM pickles this config into its engine and worker processes, so the class lives at module level.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.linear import LinearBase, MergedColumnParallelLinear, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
from vllm.transformers_utils.config import get_safetensors_params_metadata

from bitkern.nn.experts import FLOAT_PARAMETERS
from bitkern.nn.library import FLOAT_DTYPES

from ..formats import gptq, mxfp4
from . import fusion
from .checkpoint_method import CheckpointLinearMethod
from .fusion import logger
from .linear_method import BitkernLinearMethod, engine_tokens
from .moe_method import (PROJECTIONS, CheckpointMoEMethod, ImportedMoEMethod, Mxfp4MoEMethod, QuantizedMoEMethod,
                         check_experts_layer)
from .settings import Settings
from .sources import BitkernSource, QuantizedSource, checkpoint_modules, checkpoint_source

METHOD = "bitkern"
SETTINGS_OVERRIDE = "quantization_config_dict_json"  # vLLM's hf_overrides key for a config not in the checkpoint
# CUDA kernels are built for sm_80 and newer (TensorCore mma m16n8k16 in bf16)
MIN_CUDA_CAPABILITY = 80


class BitkernVllmConfig(QuantizationConfig):
    """Quantize a float checkpoint's linear layers on load with bitkern (`settings`), or serve a quantized
    checkpoint (`source`: bitkern, GPTQ, AWQ, bitsandbytes) on bitkern's kernels."""

    def __init__(self, settings: Settings | None = None, source: QuantizedSource | None = None):
        super().__init__()
        self.settings = settings or Settings()
        self.source = source

    def __repr__(self) -> str:
        if self.source is not None:
            return f"BitkernVllmConfig(checkpoint={self.source.method})"
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
        """The checkpoint's own quantization_config: a bitkern checkpoint (quant_method "bitkern"), or a GPTQ,
        AWQ or bitsandbytes one served on bitkern's kernels."""
        return cls(source=checkpoint_source(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg: dict[str, Any], user_quant: str | None,
                                     hf_config: Any = None) -> str | None:
        """Called by vLLM for a checkpoint that is already quantized: with quantization='bitkern', serve a GPTQ,
        AWQ, bitsandbytes or gpt-oss MXFP4 checkpoint on bitkern's kernels (its settings are checked here, at engine
        start); refuse other methods, and quantize-on-load settings, with a message that says why.  A bitkern
        checkpoint needs no override (vLLM reads its quant_method)."""
        method = hf_quant_cfg.get("quant_method")
        if user_quant != METHOD:
            return None
        if hf_config is not None and hasattr(hf_config, SETTINGS_OVERRIDE):
            raise ValueError(f"bitkern settings were given in hf_overrides[{SETTINGS_OVERRIDE!r}], but this "
                             f"checkpoint is already quantized with {method!r}; bitkern quantizes float checkpoints "
                             f"on load and serves quantized ones as stored: leave the settings out")
        if method == METHOD:
            return None
        checkpoint_source(hf_quant_cfg)
        return METHOD

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        """Read which modules a quantized checkpoint holds quantized from its safetensors headers (no tensors
        are read); a checkpoint without them fails here, at engine start."""
        if self.source is not None:
            self.source.read_checkpoint(get_safetensors_params_metadata(model_name, revision=revision))

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.source is not None:
            self.source.rename(hf_to_vllm_mapper.apply_list)

    def get_checkpoint_weight_mapper(self):
        """The checkpoint's tensors as the layers' parameters: GPTQ's g_idx kept (vLLM drops it by default,
        act-order layers need it), bitsandbytes' weight.absmax & co. renamed (a parameter name has no dots)."""
        renames = None if self.source is None else self.source.checkpoint_renames()
        if renames is None:
            return super().get_checkpoint_weight_mapper()
        from vllm.model_executor.models.utils import WeightsMapper

        return WeightsMapper(orig_to_new_suffix=renames)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, RoutedExperts):
            return self._experts_method(layer, prefix)
        if isinstance(layer, GateLinear):
            logger.info("bitkern: %s stays float: a mixture-of-experts router, as bitkern.quantize_model keeps "
                        "transformers' routers", prefix)
            return UnquantizedLinearMethod()
        if not isinstance(layer, LinearBase):
            return None  # embeddings and the LM head stay float, as in bitkern.quantize_model(skip=["lm_head"])
        if self.source is not None:
            return self._checkpoint_method(layer, prefix)
        if is_layer_skipped(prefix, list(self.settings.modules_to_not_convert), self.packed_modules_mapping,
                            match_mode="suffix"):
            return UnquantizedLinearMethod()
        return BitkernLinearMethod(self.settings, swiglu=self._swiglu(layer))

    def _checkpoint_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase:
        """The method of a layer of a quantized checkpoint: bitkern's if the checkpoint holds its modules
        quantized, vLLM's float one if it holds them float."""
        shards = checkpoint_modules(prefix, self.packed_modules_mapping)
        quantized = [shard in self.source.quantized for shard in shards]
        if not any(quantized):
            return UnquantizedLinearMethod()
        if not all(quantized):
            raise ValueError(f"{prefix}: the checkpoint holds {[s for s, q in zip(shards, quantized) if q]} "
                             f"quantized but {[s for s, q in zip(shards, quantized) if not q]} float; vLLM stacks "
                             f"them in one layer")
        return CheckpointLinearMethod(self.source, shards, swiglu=self._swiglu(layer))

    def _experts_method(self, layer: RoutedExperts, prefix: str) -> QuantizeMethodBase | None:
        """The method of a mixture-of-experts layer: bitkern's experts quantized on load, loaded from a bitkern
        checkpoint that holds them quantized, or converted from a GPTQ checkpoint's expert layers or gpt-oss's MXFP4
        experts; None (vLLM's float experts, logged) where modules_to_not_convert names the layer or the checkpoint
        holds its experts float."""
        if self.source is None:
            if is_layer_skipped(prefix, list(self.settings.modules_to_not_convert), self.packed_modules_mapping,
                                match_mode="suffix"):
                logger.info("bitkern: %s stays float: listed in modules_to_not_convert", prefix)
                return None
            check_experts_layer(layer, prefix)
            return QuantizedMoEMethod(layer.moe_config, self.settings, prefix)
        if self.source.method == mxfp4.QUANT_METHOD and prefix in self.source.quantized:
            gate = check_experts_layer(layer, prefix, activations=("swigluoai",))
            return Mxfp4MoEMethod(layer.moe_config, self.source, prefix, gate)
        projections = {name: f"{prefix}.{name}" for name in PROJECTIONS.values()}
        held = [module for module in projections.values() if module in self.source.quantized]
        if self.source.method != BitkernSource.method:
            if any(module.startswith(f"{prefix}.") for module in self.source.quantized):
                return self._imported_experts_method(layer, prefix)
            held = []
        if not held:
            logger.info("bitkern: %s stays float: the checkpoint holds these experts float", prefix)
            return None
        if len(held) != len(projections):
            raise ValueError(f"{prefix}: the checkpoint holds {held} quantized but not "
                             f"{sorted(set(projections.values()) - set(held))}")
        check_experts_layer(layer, prefix)
        settings = {name: self.source.config.layer_settings(f"{prefix}.{FLOAT_PARAMETERS[name]}")
                    for name in projections}
        return CheckpointMoEMethod(layer.moe_config, settings, prefix)

    def _imported_experts_method(self, layer: RoutedExperts, prefix: str) -> QuantizeMethodBase:
        """The method of experts an imported checkpoint holds quantized, one linear layer per expert and projection:
        GPTQ's (not act-order, as bitkern.load_pretrained); ValueError naming the layer for the others."""
        if self.source.method != gptq.QUANT_METHOD:
            raise ValueError(f"{prefix}: the checkpoint holds these experts quantized with {self.source.method!r}; "
                             f"bitkern's vLLM plugin serves GPTQ checkpoints' experts (one linear layer per expert, "
                             f"as GPTQModel writes them), bitkern checkpoints' experts, and quantizes float ones on "
                             f"load")
        if self.source.config.get("desc_act"):
            raise ValueError(f"{prefix}: the checkpoint's experts are act-order GPTQ layers (desc_act=True), every "
                             f"expert's inputs in an order of its own, which bitkern's grouped experts kernels do not "
                             f"take; quantize the experts with desc_act=False")
        check_experts_layer(layer, prefix)
        return ImportedMoEMethod(layer.moe_config, self.source, prefix)

    @staticmethod
    def _swiglu(layer: torch.nn.Module) -> bool:
        """Whether `layer` may be a gate/up whose SiluAndMul bitkern fuses: a merged layer, in an engine that fuses
        (fusion.py; its pass is installed here, while vLLM builds the model, before it compiles it)."""
        vllm_config = get_current_vllm_config()
        if not fusion.fusion_enabled(vllm_config):
            return False
        fusion.install(vllm_config, engine_tokens(vllm_config))
        return isinstance(layer, MergedColumnParallelLinear)
