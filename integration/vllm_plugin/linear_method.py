"""bitkern's linear method for vLLM's linear layers: the float weight of this rank's partition is loaded as vLLM
loads it (merged q/k/v and gate/up rows stacked, tensor-parallel slices cut), then quantized into a bitkern.Linear
that runs the matmul as the custom op torch.ops.bitkern.linear (so vLLM's torch.compile and CUDA graphs keep it
as one opaque call).

Quantization is per output row along the input, so stacking the rows of q/k/v (gate/up) and cutting column-parallel
slices gives the same weights as quantizing each projection alone; row-parallel slices cut the input, so each
slice must hold whole groups (checked when the weights are created).

With bitkern's fusions on (fusion.py), a merged gate/up layer keeps its rows in SwiGLU order and reads its output
back in vLLM's order, which lets the fusion pass fold vLLM's SiluAndMul into its kernel.

While the engine starts, each layer's kernels are made ready (`bitkern.prepare`'s work: loaded from the kernel
caches, the user's then the system one, or tuned) for every token count the engine runs its model at
(`engine_tokens`), so that no request waits for tuning.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.linear import LinearMethodBase, register_weight_loader_v2_supported_method
from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

import bitkern
from bitkern import ttype
from bitkern.fusion.modules import fused_calls
from bitkern.fusion.stack import swiglu_ordered, unstack_swiglu
from bitkern.nn.prepare import prepare_calls
from bitkern.nn.storage import default_group_size
from bitkern.ops.matmul import SWIGLU_BLOCK
from bitkern.ttype.quantize import check_group_size

from .fusion import logger
from .settings import Settings

QUANTIZED = "bitkern_linear"  # the layer's attribute holding its bitkern.Linear once the weights are loaded


def engine_tokens(vllm_config) -> tuple[int, ...]:
    """The token counts an engine runs its model at: every batch of up to max_num_batched_tokens tokens (decode
    batches and prefill chunks), the CUDA-graph capture sizes among them."""
    largest = vllm_config.scheduler_config.max_num_batched_tokens
    return (*range(1, largest + 1), *(vllm_config.compilation_config.cudagraph_capture_sizes or ()))


class BitkernLayerMethod(LinearMethodBase):
    """A linear method whose layer holds its bitkern.Linear (attribute QUANTIZED) once the weights are loaded.

    swiglu: the engine fuses (fusion.py) and this layer may be a merged gate/up; `plan` settles it from the layer's
    outputs, and such a layer's bitkern.Linear holds its rows in SwiGLU order."""

    def __init__(self, swiglu: bool = False):
        self.swiglu = swiglu
        self.dtype, self.tokens = None, ()

    def plan(self, output_partition_sizes: list[int], params_dtype: torch.dtype) -> None:
        """Keep SwiGLU order only for two equal outputs (gate and up) of whole SwiGLU blocks; note what `set_linear`
        prepares: inputs of `params_dtype` (vLLM's activations) at the engine's token counts."""
        gate, *rest = output_partition_sizes
        self.swiglu = self.swiglu and rest == [gate] and gate % SWIGLU_BLOCK == 0
        self.dtype, self.tokens = params_dtype, engine_tokens(get_current_vllm_config())

    def set_linear(self, layer: nn.Module, linear: bitkern.Linear) -> None:
        """Give the layer its bitkern.Linear (in SwiGLU order where planned) with its kernels ready at every token
        count the engine runs: the layer's own and, in SwiGLU order, the gate/up + SiluAndMul kernel the fusion
        pass may put in its place."""
        linear = swiglu_ordered(linear) if self.swiglu else linear
        setattr(layer, QUANTIZED, linear)
        calls = linear.kernel_calls(self.dtype) + (fused_calls(linear, self.dtype, "swiglu") if self.swiglu else [])
        report = prepare_calls(calls, self.tokens, progress=False)
        if report.built or report.loaded:
            logger.info("bitkern: %s: %s", layer.prefix, report)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = getattr(layer, QUANTIZED)(x)
        if self.swiglu:
            y = unstack_swiglu(y)
        return y if bias is None else y + bias


def served_weight(layer: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight a layer served by bitkern computes with, its rows in vLLM's order."""
    weight = getattr(layer, QUANTIZED).dequantize_weight(dtype)
    return unstack_swiglu(weight.T).T if layer.quant_method.swiglu else weight


@register_weight_loader_v2_supported_method
class BitkernLinearMethod(BitkernLayerMethod):
    """Float weights on the meta device while loading (vLLM's layerwise online processing materializes one layer
    at a time), quantized as soon as a layer's weights are all loaded: the float model is never held whole."""

    uses_meta_device = True

    def __init__(self, settings: Settings, swiglu: bool = False):
        super().__init__(swiglu)
        self.settings = settings

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        check_partition(self.settings, layer.prefix, input_size_per_partition, input_size)
        self.plan(output_partition_sizes, params_dtype)
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype, device="meta"),
            input_dim=1, output_dim=0, weight_loader=extra_weight_attrs.pop("weight_loader"))
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        initialize_online_processing(layer)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Replace the loaded float weight by its bitkern.Linear (vLLM calls this once per layer while loading and
        again for the whole model afterwards; the second call finds the weight quantized already)."""
        if hasattr(layer, QUANTIZED):
            return
        self.set_linear(layer, quantized_linear(layer.weight.data, self.settings))
        del layer.weight


def check_partition(settings: Settings, name: str, input_size_per_partition: int, input_size: int) -> None:
    """Raise naming the layer if its input partition does not hold whole quantization groups."""
    weight_type = ttype.get(settings.dtype)
    group_size = default_group_size(weight_type, settings.group_size)
    if group_size == -1 and input_size_per_partition != input_size:
        raise ValueError(f"group_size=-1 (per output channel) spans the tensor-parallel partitions of {name} "
                         f"(input {input_size} split into {input_size // input_size_per_partition}); use a group "
                         f"size that divides {input_size_per_partition}")
    try:
        check_group_size(weight_type, group_size, input_size_per_partition)
    except ValueError as error:
        split = "" if input_size_per_partition == input_size else f" (this rank's part of {input_size})"
        raise ValueError(f"{name}: input size {input_size_per_partition}{split}: {error}; or list the layer in "
                         f"modules_to_not_convert") from None


def quantized_linear(weight: torch.Tensor, settings: Settings) -> bitkern.Linear:
    """The bitkern.Linear (no bias: vLLM adds it) of a float [N, K] weight, quantized with `settings`."""
    source = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
    source.weight = nn.Parameter(weight, requires_grad=False)
    return bitkern.Linear.from_float(source, **settings.linear_options())
