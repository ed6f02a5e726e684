"""bitkern's fused-MoE methods for vLLM's mixture-of-experts layers (`RoutedExperts`, through vLLM's
`FusedMoEMethodBase`): every expert's gate/up (vLLM's w13, [gate; up] rows) and down (w2) weights become one
`bitkern.Experts`, quantized on load from a float checkpoint (`QuantizedMoEMethod`, the float weights on the meta
device until vLLM's layerwise loading materializes the layer, as vLLM's own online MoE methods do), loaded as a
bitkern checkpoint stores them (`CheckpointMoEMethod`), or converted by bitkern.load_pretrained's own conversion from
a GPTQ checkpoint that stores one linear layer per expert and projection (GPTQModel's; `ImportedMoEMethod`) or from
gpt-oss's MXFP4 experts (`Mxfp4MoEMethod`).

While the engine starts, each layer's kernels are made ready (`Experts.kernel_calls`) for every token count the engine
runs, as the linear layers' are (linear_method.py), so that no request waits for tuning.

`apply` takes vLLM's routing (top-k ids and weights) and runs the experts in one opaque custom op,
`torch.ops.bitkern.vllm_experts`: inside it `bitkern.Experts` runs the grouped kernels (a few tokens) or one dense
kernel per expert (prompts), SwiGLU on the stacked gate/up and the weighted top-k sum.  The op finds the layer by
name in vLLM's forward context, as vLLM's own MoE op does, so the routing's data-dependent shapes stay out of the
graph that vLLM's torch.compile traces (fullgraph).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase
from vllm.model_executor.layers.quantization.online.moe_base import OnlineMoEMethodBase
from vllm.model_executor.utils import set_weight_attrs

from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.activation import SwigluOAIAndMul

from bitkern import Experts
from bitkern.nn.dispatcher import op
from bitkern.nn.experts import ExpertWeights
from bitkern.nn.prepare import prepare_calls

from ..formats import mxfp4
from ..formats.checkpoint_names import STACKED
from ..formats.expert_linears import stack_experts
from ..hf.format import TENSOR_NAMES, LayerSettings, expected_experts_tensors, experts_from_checkpoint
from .fusion import logger
from .linear_method import engine_tokens
from .settings import Settings

QUANTIZED_EXPERTS = "bitkern_experts"  # the layer's attribute holding its bitkern.Experts once the weights are loaded
# the checkpoint's experts projections (bitkern's format) by vLLM's name of the layer's parameter they fill
PROJECTIONS = {"w13": "gate_up", "w2": "down"}
# vLLM's fused-checkpoint names of those projections (RoutedExperts.load_weights routes tensors named so to w13_/w2_)
FUSED_NAMES = {"gate_up": "gate_up_proj", "down": "down_proj"}
# the shards vLLM's per-expert loader hands each parameter ("w13": the gate's then the up's), and the expert linear
# layer each shard is, as the importers name them
SHARDS = {"w13": ("w1", "w3"), "w2": ("w2",)}
EXPERT_LAYERS = dict(zip(("w1", "w3", "w2"), STACKED["gate_up"] + STACKED["down"]))


@op("vllm_experts")
def vllm_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_name: str) -> torch.Tensor:
    """The routed experts' output [tokens, hidden] of the vLLM MoE layer `layer_name` (its bitkern.Experts)."""
    runner = get_forward_context().no_compile_layers[layer_name]
    return getattr(runner.routed_experts, QUANTIZED_EXPERTS)(x, topk_ids, topk_weights)


@vllm_experts.register_fake
def _vllm_experts_fake(x, topk_weights, topk_ids, layer_name):
    return torch.empty_like(x)


def check_experts_layer(layer, prefix: str, activations: tuple[str, ...] = ("silu",)):
    """The gate bitkern.Experts computes the vLLM MoE layer (`RoutedExperts`) with (None: SwiGLU, silu of the first
    half times the second; vLLM's own SwigluOAIAndMul for gpt-oss's "swigluoai", where `activations` accepts it);
    ValueError naming the layer where they cannot: other activations, the routing weights applied to the input,
    expert parallelism."""
    moe = layer.moe_config
    activation = getattr(moe.activation, "value", moe.activation)
    if activation not in activations or not moe.is_act_and_mul:
        raise ValueError(f"{prefix}: experts with activation {activation!r} (gated: {moe.is_act_and_mul}); bitkern's "
                         f"experts here compute {' or '.join(activations)}, gated; list the layer in "
                         f"modules_to_not_convert to keep it float")
    if layer.apply_router_weight_on_input:
        raise ValueError(f"{prefix}: the model applies the routing weights to the experts' input; bitkern's experts "
                         f"apply them to the outputs")
    if moe.moe_parallel_config.use_ep:
        raise ValueError(f"{prefix}: expert parallelism is not supported by bitkern's experts; serve without "
                         f"enable_expert_parallel")
    return SwigluOAIAndMul().forward_native if activation == "swigluoai" else None


class BitkernMoEMethod(FusedMoEMethodBase):
    """A fused-MoE method whose layer holds its bitkern.Experts (attribute QUANTIZED_EXPERTS) once loaded, with its
    kernels ready at the engine's token counts (noted in `create_weights`, while vLLM builds the model)."""

    dtype: torch.dtype | None = None
    tokens: tuple[int, ...] = ()

    def get_fused_moe_quant_config(self, layer):
        return None  # bitkern's experts run in `apply`; no vLLM kernel reads a quantization config

    def plan(self, params_dtype: torch.dtype) -> None:
        """Note what `set_experts` prepares: inputs of `params_dtype` (vLLM's activations) at the engine's token
        counts."""
        self.dtype, self.tokens = params_dtype, engine_tokens(get_current_vllm_config())

    def set_experts(self, layer: nn.Module, gate_up: ExpertWeights, down: ExpertWeights, settings: dict,
                    gate=None) -> None:
        """Give the layer its bitkern.Experts of these projections (`gate`: None for SwiGLU), their kernels made
        ready."""
        experts = Experts(gate_up.num_experts, down.out_features, down.in_features, gate=gate, device="meta",
                          **settings)
        experts.gate_up, experts.down = gate_up, down
        setattr(layer, QUANTIZED_EXPERTS, experts)
        report = prepare_calls(experts.kernel_calls(self.dtype, self.moe.experts_per_token), self.tokens,
                               progress=False)
        if report.built or report.loaded:
            logger.info("bitkern: %s: %s", layer.layer_name, report)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        """The routed experts' output (vLLM's MoE runner runs any shared experts itself: this method has no
        modular kernel to overlap them with)."""
        return torch.ops.bitkern.vllm_experts(x, topk_weights, topk_ids, layer.layer_name)


class QuantizedMoEMethod(BitkernMoEMethod, OnlineMoEMethodBase):
    """The float experts of this rank loaded as vLLM loads them (w13 [E, 2·I, H], w2 [E, H, I], on the meta device
    until the layer is materialized), then quantized one expert at a time with `settings`."""

    def __init__(self, moe, settings: Settings, prefix: str):
        super().__init__(moe)
        self.settings = settings
        self.prefix = prefix

    @property
    def supports_eplb(self) -> bool:
        return False

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        """vLLM's float parameters, after checking that the settings fit both projections of this partition."""
        try:
            Experts(num_experts, hidden_size, intermediate_size_per_partition, device="meta",
                    **self.settings.linear_options())
        except ValueError as error:
            raise ValueError(f"{self.prefix}: experts of hidden size {hidden_size} and intermediate size "
                             f"{intermediate_size_per_partition} (this rank's): {error}; or list the layer in "
                             f"modules_to_not_convert") from None
        self.plan(params_dtype)
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                               **extra_weight_attrs)

    def process_weights_after_loading(self, layer) -> None:
        """Replace the loaded float weights by the layer's bitkern.Experts (once: vLLM calls this per layer while
        loading and again for the whole model)."""
        if hasattr(layer, QUANTIZED_EXPERTS):
            return
        options = self.settings.linear_options()
        projections = []
        for name in PROJECTIONS:
            bias = getattr(layer, f"{name}_bias", None)
            projections.append(ExpertWeights.from_float_weight(getattr(layer, f"{name}_weight").data,
                                                               None if bias is None else bias.data, **options))
        self.set_experts(layer, *projections, options)
        for name in PROJECTIONS:
            for tensor in ("weight", "bias"):
                if hasattr(layer, f"{name}_{tensor}"):
                    delattr(layer, f"{name}_{tensor}")


class CheckpointMoEMethod(BitkernMoEMethod):
    """The experts of a bitkern checkpoint (each projection a Linear's tensors with a leading expert dimension,
    integration/hf/format.py), loaded as stored: the checkpoint's tensors are renamed (`checkpoint_renames`) so that
    vLLM's fused-checkpoint loader hands each expert's gate and up halves and down weight to this method's loader.
    Served with tensor_parallel_size=1, without biases."""

    def __init__(self, moe, settings: dict[str, LayerSettings], prefix: str):
        if moe.moe_parallel_config.tp_size > 1:
            raise ValueError(f"{prefix}: a bitkern checkpoint's experts are served with tensor_parallel_size=1")
        if moe.has_bias:
            raise ValueError(f"{prefix}: a bitkern checkpoint's experts with biases are not served by vLLM yet")
        super().__init__(moe)
        self.settings = settings  # {"gate_up": ..., "down": ...}
        self.prefix = prefix
        self.shapes: dict[str, tuple[int, int, int]] = {}
        self.names: dict[str, tuple[str, ...]] = {}

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        if (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name) != \
                ("gate_proj", "up_proj", "down_proj"):
            raise ValueError(f"{self.prefix}: vLLM's model names its experts' checkpoint weights "
                             f"{layer.ckpt_gate_proj_name}/{layer.ckpt_up_proj_name}/{layer.ckpt_down_proj_name}; "
                             f"bitkern checkpoints' experts are served for models naming them gate_proj/up_proj/"
                             f"down_proj (Qwen2-MoE, Qwen3-MoE and the like)")
        self.plan(params_dtype)
        intermediate = intermediate_size_per_partition
        self.shapes = {"w13": (num_experts, 2 * intermediate, hidden_size),
                       "w2": (num_experts, hidden_size, intermediate)}
        for name, projection in PROJECTIONS.items():
            experts, n, k = self.shapes[name]
            try:
                tensors = expected_experts_tensors(self.settings[projection], experts, k, n)
            except ValueError as error:
                raise ValueError(f"{self.prefix}.{projection}: {error}") from None
            for tensor, (shape, dtype) in tensors.items():
                parameter = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
                layer.register_parameter(f"{name}_weight_{tensor}", parameter)
                set_weight_attrs(parameter, {"weight_loader": load_expert})
            self.names[name] = tuple(tensors)

    def process_weights_after_loading(self, layer) -> None:
        if hasattr(layer, QUANTIZED_EXPERTS):
            return
        projections = []
        for name, projection in PROJECTIONS.items():
            experts, n, k = self.shapes[name]
            tensors = {tensor: getattr(layer, f"{name}_weight_{tensor}").data for tensor in self.names[name]}
            projections.append(experts_from_checkpoint(tensors, self.settings[projection], experts, k, n))
        gate_up = self.settings["gate_up"]
        self.set_experts(layer, *projections, {"dtype": gate_up.dtype, "group_size": gate_up.group_size,
                                               "zero_mode": gate_up.zero_mode})
        for name in PROJECTIONS:
            for tensor in self.names[name]:
                delattr(layer, f"{name}_weight_{tensor}")


class ImportedMoEMethod(BitkernMoEMethod):
    """The experts of a GPTQ checkpoint that stores one linear layer per expert and projection (GPTQModel's
    Qwen3-MoE; tested on it): vLLM's per-expert loader hands each layer's tensors (its expert_id; shard w1: the gate,
    w3: the up, w2: the down layer) to this method's parameters, which hold them as the checkpoint stores them under
    a leading [expert, shard] pair; once the layer is loaded, each expert's layers are converted and the gate/up rows
    stacked by bitkern.load_pretrained's own code (the importer's `convert_module`, `stack_experts`), so the experts
    dequantize bit for bit as the tool's.  Served with tensor_parallel_size=1, without biases."""

    def __init__(self, moe, source, prefix: str):
        if moe.moe_parallel_config.tp_size > 1:
            raise ValueError(f"{prefix}: a {source.method} checkpoint's experts are served with tensor_parallel_size=1")
        if moe.has_bias:
            raise ValueError(f"{prefix}: a {source.method} checkpoint's experts with biases are not served by vLLM yet")
        super().__init__(moe)
        self.source = source
        self.prefix = prefix
        self.layers: dict[str, str] = {}  # shard id -> the checkpoint's name of an expert's linear layer
        self.stored: dict[str, list] = {}  # "w13" / "w2" -> the StoredTensors of one expert's layer
        self.sizes: dict[str, tuple[int, int]] = {}  # "w13" / "w2" -> (inputs, outputs) of one expert's layer
        self.num_experts = 0

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        """One parameter per projection and tensor, [experts, shards, *the tensor as stored], after checking that the
        checkpoint holds every expert's three layers."""
        self.layers = {"w1": layer.ckpt_gate_proj_name, "w3": layer.ckpt_up_proj_name, "w2": layer.ckpt_down_proj_name}
        missing = [f"{self.prefix}.{expert}.{name}" for expert in range(num_experts) for name in self.layers.values()
                   if f"{self.prefix}.{expert}.{name}" not in self.source.quantized]
        if missing:
            raise ValueError(f"{self.prefix}: the checkpoint holds {num_experts} experts here, but not {missing[:3]} "
                             f"quantized ({len(missing)} expert layers missing)")
        self.plan(params_dtype)
        self.num_experts = num_experts
        sizes = {"w13": ("w1", hidden_size, intermediate_size_per_partition),
                 "w2": ("w2", intermediate_size_per_partition, hidden_size)}
        for name, (shard, inputs, outputs) in sizes.items():
            self.sizes[name] = inputs, outputs
            self.stored[name] = self.source.expert_tensors(f"{self.prefix}.*.{self.layers[shard]}", inputs, outputs)
            for tensor in self.stored[name]:
                shape = (num_experts, len(SHARDS[name]), *_layer_shape(tensor))
                parameter = nn.Parameter(torch.full(shape, tensor.fill, dtype=tensor.dtype), requires_grad=False)
                layer.register_parameter(f"{name}_{tensor.name}", parameter)
                set_weight_attrs(parameter, {"weight_loader": self._loader(name, tensor.name)})

    def _loader(self, name: str, tensor: str):
        """vLLM's MoE weight loader of parameter `name`_`tensor`: one expert's layer's tensor, copied as stored."""
        def load(param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str, shard_id: str, expert_id: int,
                 return_success: bool = False) -> bool:
            stored = f"{self.prefix}.{expert_id}.{self.layers[shard_id]}.{tensor}"
            target = param.data[expert_id, SHARDS[name].index(shard_id)]
            if tuple(loaded_weight.shape) != tuple(target.shape) or not _loadable(loaded_weight.dtype, target.dtype,
                                                                                  tensor):
                raise ValueError(f"{stored}: the checkpoint holds {loaded_weight.dtype} {list(loaded_weight.shape)}, "
                                 f"the layer expects {target.dtype} {list(target.shape)}")
            target.copy_(loaded_weight)  # (float scales into float32: exact)
            return True

        return load

    def process_weights_after_loading(self, layer) -> None:
        """Convert every expert's loaded layers and stack them into the layer's bitkern.Experts (once)."""
        if hasattr(layer, QUANTIZED_EXPERTS):
            return
        layers = {}
        for name, shards in SHARDS.items():
            for index, shard in enumerate(shards):
                for expert in range(self.num_experts):
                    checkpoint_name = f"{self.prefix}.{expert}.{self.layers[shard]}"
                    tensors = {tensor.name: _as_stored(tensor, getattr(layer, f"{name}_{tensor.name}").data[expert,
                                                                                                          index])
                               for tensor in self.stored[name]}
                    part = self.source.expert_partition(checkpoint_name, *self.sizes[name])
                    layers[expert, EXPERT_LAYERS[shard]] = (checkpoint_name, self.source.imported(part, tensors))
        experts = stack_experts(self.prefix, layers, self.stored["w13"][0].name)
        first = experts.weights["gate_up"][0]
        self.set_experts(layer, **experts.projections(), settings={
            "dtype": first.ttype.name, "group_size": self.source.settings["group_size"], "zero_mode": first.zero_mode})
        for name in SHARDS:
            for tensor in self.stored[name]:
                delattr(layer, f"{name}_{tensor.name}")


class Mxfp4MoEMethod(BitkernMoEMethod):
    """gpt-oss's MXFP4 experts (quant_method "mxfp4"), as vLLM's gpt-oss loader hands them over: each projection's
    blocks (w13_weight [E, 2·I, H/2], w2_weight [E, H, I/2], uint8: e2m1 codes two a byte), scales (…_weight_scale,
    uint8 e8m0 codes a block of 32) and biases whole; once loaded, converted by bitkern.load_pretrained's own
    conversion (`formats.mxfp4.convert`: the bytes carried over, so the experts dequantize bit for bit as transformers'
    Mxfp4 integration) and gated by vLLM's own "swigluoai" activation (interleaved gate and up rows, clamped).  Served
    with tensor_parallel_size=1."""

    TENSORS = {"weight": "blocks", "weight_scale": "scales", "bias": "bias"}  # vLLM's parameter -> the checkpoint's

    def __init__(self, moe, source, prefix: str, gate):
        if moe.moe_parallel_config.tp_size > 1:
            raise ValueError(f"{prefix}: gpt-oss MXFP4 experts are served with tensor_parallel_size=1")
        super().__init__(moe)
        self.source = source
        self.prefix = prefix
        self.gate = gate
        self.shapes: dict[str, tuple[int, int]] = {}  # "w13" / "w2" -> (outputs, inputs) of one expert

    def create_weights(self, layer, num_experts: int, hidden_size: int, intermediate_size_per_partition: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        """Per projection its blocks and scales (uint8) and its float32 bias (exact for the checkpoint's bf16), filled
        whole by `_load`."""
        for name, size in (("hidden", hidden_size), ("intermediate", intermediate_size_per_partition)):
            if size % mxfp4.BLOCK:
                raise ValueError(f"{self.prefix}: {name} size {size} is not a multiple of MXFP4's block of "
                                 f"{mxfp4.BLOCK}")
        self.plan(params_dtype)
        self.shapes = {"w13": (2 * intermediate_size_per_partition, hidden_size),
                       "w2": (hidden_size, intermediate_size_per_partition)}
        for name, (n, k) in self.shapes.items():
            for tensor, shape, dtype in (("weight", (n, k // 2), torch.uint8),
                                         ("weight_scale", (n, k // mxfp4.BLOCK), torch.uint8),
                                         ("bias", (n,), torch.float32)):
                parameter = nn.Parameter(torch.zeros((num_experts, *shape), dtype=dtype), requires_grad=False)
                layer.register_parameter(f"{name}_{tensor}", parameter)
                set_weight_attrs(parameter, {"weight_loader": self._load})

    def _load(self, param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str, shard_id=None,
              expert_id=None, return_success: bool = False) -> bool:
        """vLLM's weight loader: one whole tensor of the checkpoint (every expert), copied as stored."""
        if expert_id is not None or tuple(loaded_weight.shape) != tuple(param.shape) or not _loadable(
                loaded_weight.dtype, param.dtype, weight_name.rpartition(".")[2]):
            raise ValueError(f"{weight_name}: the checkpoint holds {loaded_weight.dtype} {list(loaded_weight.shape)}"
                             f"{'' if expert_id is None else f' of expert {expert_id}'}, the layer expects "
                             f"{param.dtype} {list(param.shape)} for all experts")
        param.data.copy_(loaded_weight)
        return True

    def process_weights_after_loading(self, layer) -> None:
        """Convert the loaded experts into the layer's bitkern.Experts (once)."""
        if hasattr(layer, QUANTIZED_EXPERTS):
            return
        prefix = f"{self.prefix}."
        tensors = {}
        for name, projection in PROJECTIONS.items():
            n, k = self.shapes[name]
            stored = {part: getattr(layer, f"{name}_{tensor}").data for tensor, part in self.TENSORS.items()}
            stored["blocks"] = stored["blocks"].view(-1, n, k // mxfp4.BLOCK, mxfp4.BLOCK // 2)
            tensors.update({f"{prefix}{mxfp4.PROJECTIONS[projection]}_{part}": value for part, value in stored.items()})
        projections = mxfp4.convert(tensors, prefix, self.source.settings).projections(self.dtype)
        self.set_experts(layer, **projections, settings={"dtype": "mxfp4", "group_size": mxfp4.BLOCK},
                         gate=self.gate)
        for name in PROJECTIONS:
            for tensor in self.TENSORS:
                delattr(layer, f"{name}_{tensor}")


def _loadable(stored: torch.dtype, held: torch.dtype, tensor: str) -> bool:
    """Whether a checkpoint tensor of dtype `stored` loads exactly into a parameter of dtype `held`: the same dtype,
    float scales into float32, an integer g_idx (int32 or int64 group numbers) into int32."""
    if stored == held:
        return True
    return stored.is_floating_point and held.is_floating_point or (tensor == "g_idx" and not stored.is_floating_point)


def _layer_shape(tensor) -> tuple[int, ...]:
    """The shape of one expert layer's tensor `tensor` (a StoredTensor) in the experts' parameter: a tensor stored
    one row per merged shard (g_idx) is this layer's row."""
    return tensor.shape[1:] if tensor.output_dim is None else tensor.shape


def _as_stored(tensor, value: torch.Tensor) -> torch.Tensor:
    """One expert layer's loaded `value` of `tensor` (a StoredTensor) as the source's converter takes it."""
    return value.unsqueeze(0) if tensor.output_dim is None else value


def load_expert(param: nn.Parameter, loaded_weight: torch.Tensor, weight_name: str, shard_id: str, expert_id: int,
                return_success: bool = False) -> bool:
    """vLLM's MoE weight loader call for one expert's tensor of a bitkern checkpoint: the gate (w1) or up (w3) half
    of its gate/up rows, or its whole down (w2) tensor, copied as stored."""
    target = param.data[expert_id]
    if shard_id in ("w1", "w3"):
        half = target.shape[0] // 2
        target = target[:half] if shard_id == "w1" else target[half:]
    if tuple(loaded_weight.shape) != tuple(target.shape) or loaded_weight.dtype != target.dtype:
        raise ValueError(f"{weight_name} (expert {expert_id}, {shard_id}): the checkpoint holds {loaded_weight.dtype} "
                         f"{list(loaded_weight.shape)}, the layer expects {target.dtype} {list(target.shape)}")
    target.copy_(loaded_weight)
    return True


def checkpoint_renames() -> dict[str, str]:
    """{suffix: new suffix}: a bitkern checkpoint's experts tensors (`e.gate_up.weight_scale`) under the names vLLM's
    fused-checkpoint loader routes to this method's parameters (`e.gate_up_proj_weight_scale` -> `w13_weight_weight_
    scale`)."""
    return {f".experts.{projection}.{tensor}": f".experts.{fused}_{tensor}"
            for projection, fused in FUSED_NAMES.items() for tensor in TENSOR_NAMES.values()}
