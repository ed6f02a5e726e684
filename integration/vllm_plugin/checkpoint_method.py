"""bitkern's linear method for checkpoints that are already quantized (bitkern, GPTQ, AWQ, bitsandbytes; see
sources.py).

Each layer's partition registers the checkpoint's own tensors with vLLM's parameter classes, so that vLLM's
weight loaders stack merged shards (q/k/v, gate/up) and cut tensor-parallel partitions as they do for vLLM's
own GPTQ and AWQ kernels; once a layer is loaded, its tensors become one bitkern.Linear and are dropped.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.linear import register_weight_loader_v2_supported_method
from vllm.model_executor.parameter import (BasevLLMParameter, ChannelQuantScaleParameter, ModelWeightParameter,
                                           PackedColumnParameter, PackedvLLMParameter)
from vllm.model_executor.utils import set_weight_attrs

from .linear_method import QUANTIZED, BitkernLayerMethod
from .sources import Partition, StoredTensor


class ShardRowsParameter(BasevLLMParameter):
    """A tensor stored whole per merged shard, one row each, flattened (GPTQ's g_idx: q, k and v each store
    their own; bitsandbytes' flat blocks, shorter rows padded), cut along its inputs for row-parallel layers."""

    def __init__(self, input_dim: int, **kwargs):
        self._input_dim = input_dim
        super().__init__(**kwargs)

    @property
    def input_dim(self) -> int:
        return self._input_dim

    def _store(self, row: int, loaded_weight: torch.Tensor) -> None:
        flat = loaded_weight.reshape(-1)
        if flat.numel() > self.data.shape[1]:
            raise ValueError(f"a checkpoint tensor of {flat.numel()} elements does not fit the {self.data.shape[1]} "
                             f"its header gave")
        self.data[row, :flat.numel()].copy_(flat)

    def load_column_parallel_weight(self, loaded_weight: torch.Tensor):
        self._store(0, loaded_weight)

    def load_row_parallel_weight(self, loaded_weight: torch.Tensor):
        size = self.data.shape[self.input_dim]
        self._store(0, loaded_weight.narrow(0, self.tp_rank * size, size) if self.tp_size > 1 else loaded_weight)

    def load_merged_column_weight(self, loaded_weight: torch.Tensor, **kwargs):
        self._store(self._shard_id_as_int(kwargs["shard_id"]), loaded_weight)

    def load_qkv_weight(self, loaded_weight: torch.Tensor, **kwargs):
        self._store(self._shard_id_as_int(kwargs["shard_id"]), loaded_weight)


def vllm_parameter(stored: StoredTensor, weight_loader) -> BasevLLMParameter:
    """The vLLM parameter class whose loaders stack and cut `stored` along its axes."""
    if stored.output_dim is None:
        data = torch.full(stored.shape, stored.fill, dtype=stored.dtype)
        return ShardRowsParameter(data=data, input_dim=stored.input_dim, weight_loader=weight_loader)
    data = torch.zeros(stored.shape, dtype=stored.dtype)
    axes = {"output_dim": stored.output_dim, "weight_loader": weight_loader}
    if stored.outputs_per_element != 1:
        packing = {"packed_dim": stored.output_dim, "packed_factor": stored.outputs_per_element}
        if stored.input_dim is None:
            return PackedColumnParameter(data=data, **packing, **axes)
        return PackedvLLMParameter(data=data, input_dim=stored.input_dim, **packing, **axes)
    if stored.input_dim is None:
        return ChannelQuantScaleParameter(data=data, **axes)
    return ModelWeightParameter(data=data, input_dim=stored.input_dim, **axes)


@register_weight_loader_v2_supported_method
class CheckpointLinearMethod(BitkernLayerMethod):
    """One vLLM linear layer of a quantized checkpoint (`source`), stacked from the checkpoint modules `shards`."""

    def __init__(self, source, shards: tuple[str, ...], swiglu: bool = False):
        super().__init__(swiglu)
        self.source = source
        self.shards = shards
        self.partition: Partition | None = None
        self.names: tuple[str, ...] = ()

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        if len(output_partition_sizes) != len(self.shards):
            raise ValueError(f"{layer.prefix}: vLLM stacks {len(output_partition_sizes)} outputs in this layer, the "
                             f"checkpoint modules {list(self.shards)} are {len(self.shards)}")
        self.plan(output_partition_sizes, params_dtype)
        self.partition = Partition(layer.prefix, self.shards, tuple(output_partition_sizes), input_size_per_partition,
                                   input_size)
        weight_loader = extra_weight_attrs.pop("weight_loader")
        stored = self.source.stored_tensors(self.partition)
        for tensor in stored:
            parameter = vllm_parameter(tensor, weight_loader)
            layer.register_parameter(tensor.name, parameter)
            set_weight_attrs(parameter, extra_weight_attrs)
        self.names = tuple(tensor.name for tensor in stored)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert the loaded tensors into the layer's bitkern.Linear (once; vLLM may call this again)."""
        if hasattr(layer, QUANTIZED):
            return
        tensors = {name: getattr(layer, name).data for name in self.names}
        self.set_linear(layer, self.source.linear(self.partition, tensors))
        for name in self.names:
            delattr(layer, name)
