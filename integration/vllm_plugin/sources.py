"""Checkpoints already quantized as vLLM loads them into bitkern layers: the tensors one linear layer's
tensor-parallel partition holds as the checkpoint stores them (shapes, dtypes, the axes vLLM stacks merged
shards along and cuts partitions of), and how they become one bitkern.Linear.

bitkern's own checkpoints (transformers' save_pretrained of a BitkernConfig model, integration/hf/format.py)
load as stored; GPTQ, AWQ and bitsandbytes 4-bit ones go through the importers (bitkern.integration.formats),
bit for bit the tool's own dequantization, as do gpt-oss's MXFP4 experts (its linear layers are float).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

import bitkern
from bitkern import ttype
from bitkern.ttype import QuantizedWeight

from ..formats import FORMATS, FormatError, ImportedLinear, awq, bnb, convert_module, gptq, mxfp4, quantized_modules
from ..formats.bitstream import block_codes, stream_length
from ..formats.convert import quantization_settings
from ..hf.config import BitkernConfig
from ..hf.format import expected_tensors, linear_from_checkpoint
from .moe_method import checkpoint_renames as experts_renames

# float scales are loaded as float32 (exact for every source dtype), then kept in the narrowest dtype that
# holds every value exactly
SCALE_DTYPES = (torch.float16, torch.bfloat16)
NO_GROUP_INDEX = -1  # fills g_idx before loading: a checkpoint without g_idx leaves it so


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a layer partition as the checkpoint stores it.

    output_dim: the axis along which vLLM stacks merged shards (q/k/v, gate/up) and cuts column-parallel
    slices, None for a tensor stored whole per merged shard, one row each (GPTQ's g_idx, bitsandbytes'
    tensors); outputs_per_element: the
    outputs one stored element along it holds (8 for 4-bit codes packed into int32 along the outputs);
    input_dim: the axis cut for row-parallel layers, None where every rank loads the tensor whole; fill: its
    value until loaded (what a tensor the checkpoint lacks keeps).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    output_dim: int | None
    input_dim: int | None
    outputs_per_element: Fraction = Fraction(1)
    fill: int = 0


@dataclass(frozen=True)
class Partition:
    """This rank's part of one vLLM linear layer: its name, the checkpoint modules stacked in it (q_proj,
    k_proj, v_proj of a merged qkv_proj) with this rank's outputs of each, and its inputs of the layer's."""

    name: str
    shards: tuple[str, ...]
    outputs: tuple[int, ...]
    inputs: int
    total_inputs: int

    @property
    def split(self) -> bool:
        """Whether the layer's inputs are cut across ranks (a row-parallel layer with tensor parallelism)."""
        return self.inputs != self.total_inputs

    def fail(self, problem: str) -> ValueError:
        return ValueError(f"{self.name}: {problem}")


class QuantizedSource:
    """A quantized checkpoint: which of its modules it holds quantized (read from its safetensors headers)."""

    method = ""

    def __init__(self):
        self.modules: list[str] = []  # the checkpoint's quantized modules, as it names them
        self.quantized: set[str] = set()  # the same, as vLLM names them

    def quantized_modules(self, tensor_names) -> list[str]:
        raise NotImplementedError

    def read_checkpoint(self, headers: dict) -> None:
        """Record which modules the checkpoint holds quantized from its safetensors headers ({tensor name:
        {"dtype", "shape"}}); FormatError if none, or naming a missing tensor."""
        self.modules = self.quantized_modules(headers)
        self.quantized = set(self.modules)

    def checkpoint_renames(self) -> dict[str, str | None] | None:
        """{suffix: new suffix} renaming the checkpoint's tensors to the layer's parameters (an empty dict: as
        they are), or None for vLLM's default (which drops g_idx)."""
        return None

    def rename(self, rename) -> None:
        """Name the quantized modules as vLLM's model does (`rename`: a list of checkpoint names -> vLLM's)."""
        self.quantized = set(rename(self.modules))


class BitkernSource(QuantizedSource):
    """A checkpoint saved by transformers from a model quantized with BitkernConfig: every quantized module's
    tensors (weight: packed codes, weight_scale, weight_zero) are the bitkern.Linear's own, loaded as stored."""

    method = "bitkern"
    SCALE = "weight_scale"  # every quantized module has one; float modules do not

    def __init__(self, quantization_config: dict):
        super().__init__()
        self.config = BitkernConfig.from_dict(quantization_config)

    def quantized_modules(self, tensor_names) -> list[str]:
        modules = sorted(name.removesuffix("." + self.SCALE) for name in tensor_names
                         if name.endswith("." + self.SCALE))
        if not modules:
            raise FormatError(f"the checkpoint's config says quant_method 'bitkern' but it holds no bitkern layers "
                              f"(tensors named *.{self.SCALE}); was it saved by save_pretrained of a bitkern model?")
        return modules

    def checkpoint_renames(self) -> dict[str, str]:
        return experts_renames()  # (its dense layers' tensors load as they are named)

    def layer_settings(self, part: Partition):
        """The settings of the checkpoint modules stacked in this layer (they must agree)."""
        settings = {shard: self.config.layer_settings(shard) for shard in part.shards}
        if len(set(settings.values())) > 1:
            raise part.fail(f"vLLM stacks {list(part.shards)} in one layer, which the checkpoint quantized with "
                            f"different settings: {settings}")
        return settings[part.shards[0]]

    def stored_tensors(self, part: Partition) -> list[StoredTensor]:
        settings = self.layer_settings(part)
        outputs = sum(part.outputs)
        try:
            here = expected_tensors(settings, part.inputs, outputs)
            whole = expected_tensors(settings, part.total_inputs, outputs)
        except ValueError as error:
            split = f" (this rank's part of {part.total_inputs})" if part.split else ""
            raise part.fail(f"input size {part.inputs}{split}: {error}") from None
        per_word = 32 // ttype.get(settings.dtype).bits  # codes packed along the inputs, none straddling words
        if part.split and part.inputs % per_word:
            raise part.fail(f"this rank's {part.inputs} of {part.total_inputs} inputs are not whole words of "
                            f"{per_word} {settings.dtype} codes; use another tensor_parallel_size")
        tensors = []
        for name, (shape, dtype) in here.items():
            if len(shape) != 2:
                raise part.fail(f"{settings.dtype} keeps one scale per tensor ({name}), which vLLM's merged and "
                                f"tensor-parallel layers cannot share")
            split = whole[name][0][1] != shape[1]  # (a per-channel scale is every rank's whole)
            tensors.append(StoredTensor(name, shape, dtype, 0, 1 if split else None))
        return tensors

    def linear(self, part: Partition, tensors: dict[str, torch.Tensor]) -> bitkern.Linear:
        return linear_from_checkpoint(tensors, self.layer_settings(part), part.inputs, sum(part.outputs))


class ImportedSource(QuantizedSource):
    """A GPTQ, AWQ or gpt-oss MXFP4 checkpoint (its quantization_config) served on bitkern's kernels."""

    def __init__(self, quantization_config: dict):
        super().__init__()
        self.config = dict(quantization_config)
        method = self.config.get("quant_method")
        if method not in IMPORTED:
            raise FormatError(f"quantization='bitkern' serves float, bitkern, gptq, awq, bitsandbytes (4-bit) and "
                              f"gpt-oss mxfp4 checkpoints; this one is quantized with quant_method={method!r}")
        self.settings = quantization_settings(self.config)[1]
        self.method = method  # (the format module itself is looked up by it: vLLM pickles this object)
        if self.config.get("lm_head"):
            raise FormatError("quantization_config lm_head=True: a quantized output embedding is not supported; "
                              "vLLM keeps lm_head float")
        if self.config.get("dynamic"):
            raise FormatError(f"quantization_config dynamic={self.config['dynamic']!r}: per-module GPTQ settings are "
                              f"not supported")

    def quantized_modules(self, tensor_names) -> list[str]:
        modules = quantized_modules(tensor_names, self.config)
        if not modules:
            raise FormatError(f"the checkpoint holds no {self.method} tensors (looked for keys ending in "
                              f"{', '.join(FORMATS[self.method].TENSORS)})")
        names = set(tensor_names)
        for module in modules:
            for tensor in REQUIRED[self.method]:
                if f"{module}.{tensor}" not in names:
                    raise FormatError(f"tensor {module + '.' + tensor!r} is missing from the checkpoint")
        return modules

    def checkpoint_renames(self) -> dict[str, str | None] | None:
        return {} if self.method == gptq.QUANT_METHOD else None  # act-order layers need GPTQ's g_idx

    def stored_tensors(self, part: Partition) -> list[StoredTensor]:
        """The tensors of this partition in the checkpoint's layout (ValueError naming the layer where the
        partition does not hold whole packed words or whole groups)."""
        return (_gptq_tensors if self.method == gptq.QUANT_METHOD else _awq_tensors)(part, self.config, self.settings)

    def expert_tensors(self, name: str, inputs: int, outputs: int) -> list[StoredTensor]:
        """The tensors of one expert's linear layer `name` (GPTQModel stores each expert's gate, up and down as one),
        as the checkpoint stores them; ValueError naming the layer where they do not hold whole words or groups."""
        return self.stored_tensors(self.expert_partition(name, inputs, outputs))

    @staticmethod
    def expert_partition(name: str, inputs: int, outputs: int) -> Partition:
        """One expert's linear layer as a partition of its own (experts are served with tensor_parallel_size=1)."""
        return Partition(name, (name,), (outputs,), inputs, inputs)

    def linear(self, part: Partition, tensors: dict[str, torch.Tensor]) -> bitkern.Linear:
        """The bitkern.Linear of this partition's loaded tensors (no bias: vLLM adds it)."""
        return self.imported(part, tensors).to_module()

    def imported(self, part: Partition, tensors: dict[str, torch.Tensor]) -> ImportedLinear:
        """This partition's loaded tensors converted by the importer (`convert_module`, bitkern.load_pretrained's),
        its merged shards stacked."""
        tensors = dict(tensors, scales=narrowest_exact(tensors["scales"]))
        group_index = tensors.pop("g_idx", None)
        imported, offset = [], 0
        for shard, (name, outputs) in enumerate(zip(part.shards, part.outputs)):
            columns = {key: _output_slice(self.method, key, value, offset, outputs, self.settings)
                       for key, value in tensors.items()}
            if group_index is not None:
                order = _shard_group_index(part, group_index[shard], self.settings["group_size"])
                if order is not None:
                    columns["g_idx"] = order
            imported.append(convert_module({f"{name}.{key}": value for key, value in columns.items()}, f"{name}.",
                                           self.config))
            offset += outputs
        return stack_outputs(part, imported)


class BnbSource(QuantizedSource):
    """A bitsandbytes 4-bit checkpoint (nf4, fp4, double quantization), served with tensor_parallel_size=1: its
    blocks and their nested scales run through each module's flat weight across rows, so every module's tensors
    are loaded whole (one row per merged shard, shapes from the checkpoint's headers) and converted by the
    importer."""

    method = bnb.QUANT_METHOD

    def __init__(self, quantization_config: dict):
        super().__init__()
        self.config = dict(quantization_config)
        quantization_settings(self.config)
        self.stored: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # checkpoint tensor -> shape, dtype

    def quantized_modules(self, headers) -> list[str]:
        modules = quantized_modules(headers, self.config)
        if not modules:
            raise FormatError(f"the checkpoint holds no bitsandbytes 4-bit tensors (keys ending in "
                              f"{', '.join(bnb.TENSORS)})")
        for module in modules:
            for suffix in bnb.OWNED:
                if f"{module}.{suffix}" in headers:
                    header = headers[f"{module}.{suffix}"]
                    self.stored[f"{module}.{suffix}"] = tuple(header["shape"]), SAFETENSORS_DTYPES[header["dtype"]]
            for suffix in ("weight", "weight.absmax", "weight.quant_map"):
                if f"{module}.{suffix}" not in self.stored:
                    raise FormatError(f"tensor {module + '.' + suffix!r} is missing from the checkpoint")
        return modules

    def checkpoint_renames(self) -> dict[str, str | None]:
        return {f".{suffix}": f".{parameter_name(suffix)}" for suffix in bnb.TENSORS}

    def stored_tensors(self, part: Partition) -> list[StoredTensor]:
        for shard, outputs in zip(part.shards, part.outputs):
            shape, dtype = self.stored[f"{shard}.weight"]
            whole = 2 * shape[0] * dtype.itemsize // part.total_inputs
            if part.split or outputs != whole:
                raise part.fail(f"bitsandbytes checkpoints are served with tensor_parallel_size=1 (their blocks "
                                f"run across rows; {shard} has {whole} outputs, this rank {outputs})")
        tensors = []
        for suffix in bnb.OWNED:
            found = [self.stored.get(f"{shard}.{suffix}") for shard in part.shards]
            if not any(found):
                continue
            if not all(found) or len({dtype for _, dtype in found}) != 1:
                raise part.fail(f"the checkpoint modules {list(part.shards)} that vLLM stacks in this layer do not "
                                f"all hold {suffix} of one dtype: {found}")
            length = max(_numel(shape) for shape, _ in found)
            tensors.append(StoredTensor(parameter_name(suffix), (len(part.shards), length), found[0][1], None, 1))
        return tensors

    def linear(self, part: Partition, tensors: dict[str, torch.Tensor]) -> bitkern.Linear:
        imported = []
        for row, shard in enumerate(part.shards):
            own = {}
            for suffix in bnb.OWNED:
                if f"{shard}.{suffix}" in self.stored:
                    shape = self.stored[f"{shard}.{suffix}"][0]
                    own[f"{shard}.{suffix}"] = tensors[parameter_name(suffix)][row, :_numel(shape)].reshape(shape)
            imported.append(convert_module(own, f"{shard}.", self.config))
        return stack_outputs(part, imported).to_module()


def parameter_name(suffix: str) -> str:
    """The layer parameter holding a checkpoint tensor of a module (a name without dots)."""
    return suffix.replace(".", "_")


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _gptq_tensors(part: Partition, config: dict, settings: dict) -> list[StoredTensor]:
    bits, group_size = settings["bits"], settings["group_size"]
    k, n = part.inputs, sum(part.outputs)
    whole = block_codes(bits)
    if k % whole:
        raise part.fail(f"{k} inputs on this rank do not fill whole {bits}-bit GPTQ words (multiples of {whole})")
    if any(outputs % whole for outputs in part.outputs):
        raise part.fail(f"outputs {list(part.outputs)} on this rank do not fill whole {bits}-bit GPTQ zero words "
                        f"(multiples of {whole}); use a smaller tensor_parallel_size")
    grouped = _check_groups(part, group_size)
    if part.split and config.get("desc_act"):
        raise part.fail("an act-order GPTQ layer (desc_act=True) cannot be cut along its inputs for tensor "
                        "parallelism: its groups are spread over all inputs; use tensor_parallel_size=1")
    groups = k // group_size if grouped else 1
    per_word = Fraction(32, bits)
    return [StoredTensor("qweight", (stream_length(k, bits), n), torch.int32, 1, 0),
            StoredTensor("qzeros", (groups, stream_length(n, bits)), torch.int32, 1, 0 if grouped else None, per_word),
            StoredTensor("scales", (groups, n), torch.float32, 1, 0 if grouped else None),
            StoredTensor("g_idx", (len(part.shards), k), torch.int32, None, 1, fill=NO_GROUP_INDEX)]


def _awq_tensors(part: Partition, config: dict, settings: dict) -> list[StoredTensor]:
    k, n = part.inputs, sum(part.outputs)
    per_word = 32 // awq.BITS
    if any(outputs % per_word for outputs in part.outputs):
        raise part.fail(f"outputs {list(part.outputs)} on this rank do not fill whole AWQ words (multiples of "
                        f"{per_word}); use a smaller tensor_parallel_size")
    grouped = _check_groups(part, settings["group_size"])
    groups = k // settings["group_size"] if grouped else 1
    return [StoredTensor("qweight", (k, n // per_word), torch.int32, 1, 0, Fraction(per_word)),
            StoredTensor("qzeros", (groups, n // per_word), torch.int32, 1, 0 if grouped else None, Fraction(per_word)),
            StoredTensor("scales", (groups, n), torch.float32, 1, 0 if grouped else None)]


def _check_groups(part: Partition, group_size: int) -> bool:
    """Whether the layer has groups along its inputs (else one per output row); ValueError naming the layer
    if this rank's inputs do not hold whole groups."""
    if group_size == -1:
        return False
    if part.inputs % group_size:
        split = f" (this rank's part of {part.total_inputs})" if part.split else ""
        raise part.fail(f"input size {part.inputs}{split} is not a whole number of the checkpoint's groups of "
                        f"{group_size}; use a tensor_parallel_size that keeps groups whole")
    return True


def _output_slice(method: str, key: str, value: torch.Tensor, offset: int, outputs: int, settings: dict):
    """The columns of one shard (outputs [offset, offset + outputs)) of a stacked tensor."""
    if key == "g_idx":
        return value
    if method == gptq.QUANT_METHOD and key == "qzeros":
        bits = settings["bits"]
        start, stop = stream_length(offset, bits), stream_length(offset + outputs, bits)
    elif method == awq.QUANT_METHOD and key != "scales":
        per_word = 32 // awq.BITS
        start, stop = offset // per_word, (offset + outputs) // per_word
    else:
        start, stop = offset, offset + outputs
    return value[:, start:stop].contiguous()


def _shard_group_index(part: Partition, group_index: torch.Tensor, group_size: int) -> torch.Tensor | None:
    """A shard's g_idx as the importer reads it: None where the checkpoint has none (left at NO_GROUP_INDEX)
    or this rank holds a slice of consecutive groups (renumbered from 0 by the importer's default)."""
    if bool((group_index == NO_GROUP_INDEX).all()):
        return None
    if not part.split:
        return group_index
    width = part.inputs if group_size == -1 else group_size
    consecutive = torch.arange(part.inputs, dtype=group_index.dtype) // width
    if torch.equal(group_index - group_index[0], consecutive):
        return None
    raise part.fail("g_idx of this rank's slice of the inputs is not consecutive groups (an act-order layer); use "
                    "tensor_parallel_size=1")


def narrowest_exact(scales: torch.Tensor) -> torch.Tensor:
    """float32 scales in the narrowest float dtype that holds every value exactly (as the checkpoint stored
    them: float16 for GPTQ and AWQ)."""
    for dtype in SCALE_DTYPES:
        narrow = scales.to(dtype)
        if torch.equal(narrow.float(), scales):
            return narrow
    return scales


def stack_outputs(part: Partition, imported: list[ImportedLinear]) -> ImportedLinear:
    """The shards of a merged layer as one layer, their rows stacked (one matmul per call); their act-order
    permutations must agree, since the layer gathers x's columns once."""
    first = imported[0]
    if len(imported) == 1:
        return first
    for shard, other in zip(part.shards[1:], imported[1:]):
        same = (first.input_order is None and other.input_order is None) or (
            first.input_order is not None and other.input_order is not None
            and torch.equal(first.input_order, other.input_order))
        if not same:
            raise part.fail(f"{shard} has another act-order permutation (g_idx) than {part.shards[0]}; bitkern runs "
                            f"vLLM's merged layer as one matmul, which needs one")
    weights = [item.weight for item in imported]
    zeros = None if first.weight.zeros is None else torch.cat([w.zeros for w in weights])
    weight = QuantizedWeight(first.weight.ttype, (sum(w.shape[0] for w in weights), first.weight.shape[1]),
                             first.weight.group_size, first.weight.zero_mode, torch.cat([w.qweight for w in weights]),
                             torch.cat([w.scales for w in weights]), zeros)
    return ImportedLinear(weight, first.input_order)


# served by ImportedSource (mxfp4: experts only); bitsandbytes by BnbSource
IMPORTED = (gptq.QUANT_METHOD, awq.QUANT_METHOD, mxfp4.QUANT_METHOD)
REQUIRED = {gptq.QUANT_METHOD: ("qweight", "qzeros", "scales"), awq.QUANT_METHOD: awq.TENSORS,
            mxfp4.QUANT_METHOD: mxfp4.OWNED}
# vLLM renames gpt-oss's quant_method "mxfp4" so in the config it hands over (GptOssForCausalLMConfig)
VLLM_METHODS = {"gpt_oss_mxfp4": mxfp4.QUANT_METHOD}
SAFETENSORS_DTYPES = {"U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
                      "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
                      "F64": torch.float64}


def checkpoint_source(quantization_config: dict) -> QuantizedSource:
    """The source serving a quantized checkpoint of this quantization_config on bitkern's kernels; ValueError
    naming what is not supported (checked while vLLM builds its config, i.e. at engine start)."""
    if not isinstance(quantization_config, dict):
        raise TypeError(f"a checkpoint's quantization_config is a dict, got {type(quantization_config).__name__}")
    method = quantization_config.get("quant_method")
    if method in VLLM_METHODS:
        quantization_config = dict(quantization_config, quant_method=VLLM_METHODS[method])
    if method == BitkernSource.method:
        return BitkernSource(quantization_config)
    if method == BnbSource.method:
        return BnbSource(quantization_config)
    return ImportedSource(quantization_config)


def checkpoint_modules(prefix: str, packed_modules_mapping: dict) -> tuple[str, ...]:
    """The checkpoint modules vLLM stacks in its layer `prefix` (q_proj, k_proj, v_proj for a qkv_proj)."""
    parent, _, name = prefix.rpartition(".")
    if name not in packed_modules_mapping:
        return (prefix,)
    return tuple(f"{parent}.{part}" if parent else part for part in packed_modules_mapping[name])
