"""What bitkern's modules share: one [N, K] weight stored in a bitkern type, its settings and its state.

The weight lives in buffers in a kernel layout (`bitkern.pack`).  Float metadata (fp16/bf16/fp32 scales,
hqq's float zeros, nvfp4's tensor scale) is held as raw bits in same-width integer tensors, so that
module-wide casts such as `model.half()` or `model.to(torch.bfloat16)` never round the weight; device
moves (`.to(device)`, `.cpu()`, `.to_empty()`) move it unchanged.  The settings travel in the state dict
as the module's extra state and are checked on load before any tensor is copied.
"""

from __future__ import annotations

import abc
import logging

import torch
from torch import nn

from .. import ttype
from ..codegen import PackedWeight, layout_for, pack, packed_class, to_layout
from ..codegen.cpu.layout import aligned
from ..ops import Matmul
from ..ttype import Layout, QuantizedWeight, StoredWeight, WeightFormat, dtype_name
from ..ttype.quantize import (CAST_TYPES, DEFAULT_GROUP_SIZE, SCALE_DTYPES, check_group_size, check_method,
                              METHODS, check_zero_mode, default_zero_mode)
from . import library
from .library import FLOAT_DTYPES, raw_bits

log = logging.getLogger("bitkern")

STATE_FORMAT = "bitkern.weight/1"
WEIGHT_BUFFERS = StoredWeight.TENSORS
# Settings a checkpoint must share with the module it is loaded into (the rest of the state is geometry).
WEIGHT_SETTINGS = ("dtype", "group_size", "zero_mode", "scale_dtype", "weight_shape")


def weight_dtypes() -> list[str]:
    """Registered types a module can store its weight in (at most 8 bits per element, and bfloat16: a bf16 weight
    as it is)."""
    return [name for name in ttype.names() if ttype.get(name).bits <= 8 or name in CAST_TYPES]


def check_weight_dtype(dtype) -> str:
    """The name of a storable weight type, given by name, as a TType or as a torch dtype that names one (as
    `bitkern.quantize` takes them: torch.int8 is "int8"); ValueError naming `dtype` and the accepted names
    otherwise."""
    if isinstance(dtype, (str, ttype.TType, torch.dtype)):
        try:
            name = ttype.get(dtype).name
        except ValueError:
            name = None
        if name in weight_dtypes():
            return name
    raise ValueError(f"dtype={dtype!r} is not supported for weights; accepted: {', '.join(weight_dtypes())}")


def check_float_dtype(argument: str, dtype, accepted: tuple, allow_none: bool = False):
    """A torch float dtype (given as such or by name) from `accepted`; ValueError naming `argument` otherwise."""
    if dtype is None and allow_none:
        return None
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if value not in accepted:
        names = [dtype_name(d) for d in accepted] + (["None"] if allow_none else [])
        raise ValueError(f"{argument}={dtype!r} is not supported; accepted: {', '.join(names)}")
    return value


def check_positive(argument: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{argument}={value!r} must be a positive int")
    return value


def default_group_size(weight_type, group_size):
    """None means 128, or the fixed block of a block-scaled type (mxfp4: 32, nvfp4: 16)."""
    if group_size is None:
        return weight_type.block_size if weight_type.block_size > 1 else DEFAULT_GROUP_SIZE
    return group_size


def kernel_layout(weight_dtype: str, device: torch.device) -> Layout | None:
    """The layout the kernels for `device` read, or None where bitkern has no kernels to ask (meta)."""
    return layout_for(ttype.get(weight_dtype), device.type) if device.type in ("cpu", "cuda") else None


class QuantizedModule(nn.Module, abc.ABC):
    """Base of `bitkern.Linear` and `bitkern.Conv2d`: a weight of `weight_shape` computed as a [N, K] GEMM.

    Attributes: weight_dtype (type name), group_size (resolved: in_features for per-channel), zero_mode,
    method (how the weight's scales and zeros were chosen, `bitkern.quantize`'s: recorded, never re-run),
    scale_dtype, layout (of the buffers), compute_dtype (None: the input's dtype), activation_quant (a
    `bitkern.ops.Matmul` activation quantization: "int8" quantizes x per 32 inputs to int8 in the kernel);
    float_class: the torch module a subclass quantizes (`from_float`); activation_quants: the activation
    quantizations its kernels apply.
    """

    float_class: type
    activation_quants: tuple = ("none",)

    def _configure(self, weight_shape: tuple, dtype, group_size, zero_mode, scale_dtype, compute_dtype,
                   activation_quant: str = "none", method: str = "rtn") -> None:
        """Validate and record the weight settings (before any tensor is made)."""
        self.weight_shape = tuple(weight_shape)
        self.weight_dtype = check_weight_dtype(dtype)
        weight_type = ttype.get(self.weight_dtype)
        k = self.gemm_shape[1]
        self.group_size = check_group_size(weight_type, default_group_size(weight_type, group_size), k)
        self.zero_mode = default_zero_mode(weight_type) if zero_mode is None else zero_mode
        check_zero_mode(weight_type, self.zero_mode)
        check_method(weight_type, method, calibrated=True)  # recorded; quantize refuses a calibrated one itself
        self.method = method
        self.scale_dtype = check_float_dtype("scale_dtype", scale_dtype, SCALE_DTYPES)
        self.compute_dtype = compute_dtype
        self.activation_quant = activation_quant
        self.layout = Layout.ROWMAJOR

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype x is multiplied in (None: x's own); settable, e.g. to switch a loaded model to bfloat16."""
        return self._compute_dtype

    @compute_dtype.setter
    def compute_dtype(self, dtype) -> None:
        self._compute_dtype = check_float_dtype("compute_dtype", dtype, FLOAT_DTYPES, allow_none=True)

    @property
    def activation_quant(self) -> str:
        """How the kernel quantizes x before multiplying ("none", or "int8": per row and 32 inputs, symmetric, as
        llama.cpp's Q8_0 activations); settable."""
        return self._activation_quant

    @activation_quant.setter
    def activation_quant(self, value: str) -> None:
        if value not in self.activation_quants:
            raise ValueError(f"activation_quant={value!r} is not supported by bitkern.{type(self).__name__}; "
                             f"accepted: {list(self.activation_quants)}")
        if value != "none":  # the operator's own conditions (integer weight types, groups of whole blocks)
            n, k = self.gemm_shape
            Matmul(self.weight_dtype, "bfloat16", group_size=self.group_size, zero_mode=self.zero_mode,
                   activation_quant=value).check_shape(n, k)
        self._activation_quant = value

    @property
    def gemm_shape(self) -> tuple[int, int]:
        """(N, K) of the weight as a matrix: outputs by reduction length."""
        return self.weight_shape[0], int(torch.Size(self.weight_shape[1:]).numel())

    # -- storing the weight ---------------------------------------------------------------------------

    def _set_weight(self, weight: torch.Tensor) -> None:
        """Quantize a float weight of `weight_shape` and store it in the kernel layout of its device; a meta
        weight gives empty meta buffers (filled by `load_state_dict(..., assign=True)` or `bitkern.load`)."""
        if tuple(weight.shape) != self.weight_shape:
            raise ValueError(f"weight has shape {tuple(weight.shape)}, expected {self.weight_shape}")
        if weight.is_meta:
            self._store_empty(Layout.ROWMAJOR, weight.device)
            return
        q = ttype.quantize(self._gemm_matrix(weight.detach()), self.weight_dtype, group_size=self.group_size,
                           zero_mode=self.zero_mode, scale_dtype=self.scale_dtype, method=self.method)
        self._store(pack(q))

    @classmethod
    def from_float(cls, module: nn.Module, dtype="nf4", group_size=None, zero_mode: str | None = None,
                   compute_dtype=None, scale_dtype=torch.float16, activation_quant: str = "none",
                   method: str = "rtn") -> "QuantizedModule":
        """Quantize a float module of `float_class` (its weight's device and values; the bias is copied as it is);
        the settings are those of the class's constructor (method: `bitkern.quantize`'s, "rtn" or "hqq")."""
        if not isinstance(module, cls.float_class):
            raise TypeError(f"module must be a torch.nn.{cls.float_class.__name__}, got {type(module).__name__}")
        layer = cls._meta_layer(module, dtype=dtype, group_size=group_size, zero_mode=zero_mode,
                                compute_dtype=compute_dtype, scale_dtype=scale_dtype, activation_quant=activation_quant,
                                method=method)
        return layer._take_parameters(module)

    @classmethod
    @abc.abstractmethod
    def _meta_layer(cls, module: nn.Module, **settings) -> "QuantizedModule":
        """An empty layer on the meta device with the geometry of `module` (a float one, or a bitkern one of this
        class) and these settings: what `from_float` fills, and what a checkpoint is checked and loaded into."""

    def _take_parameters(self, module: nn.Module) -> "QuantizedModule":
        """This layer with the float `module`'s weight quantized and its bias (or None) copied as it is."""
        self._set_weight(module.weight)
        bias = module.bias
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias.detach().clone(),
                                                                               requires_grad=bias.requires_grad))
        return self

    def _give_parameters(self, module: nn.Module, dtype: torch.dtype) -> nn.Module:
        """The float `module` (built on meta in `dtype`) holding the dequantized weight and this layer's bias."""
        module.weight = nn.Parameter(self.dequantize_weight(dtype))
        if self.bias is not None:
            module.bias = nn.Parameter(self.bias.detach().to(dtype).clone(), requires_grad=self.bias.requires_grad)
        return module

    def _gemm_matrix(self, weight: torch.Tensor) -> torch.Tensor:
        """The [N, K] matrix the kernels multiply by, from a weight of `weight_shape`."""
        return weight.reshape(self.gemm_shape)

    def _from_gemm_matrix(self, matrix: torch.Tensor) -> torch.Tensor:
        """The inverse of `_gemm_matrix`."""
        return matrix.reshape(self.weight_shape)

    def weight_format(self, layout) -> WeightFormat:
        """The format of this module's weight in `layout`."""
        block = ttype.get(self.weight_dtype).block_size > 1
        return WeightFormat(self.weight_dtype, self.gemm_shape, self.group_size, self.zero_mode,
                            "uint8" if block else dtype_name(self.scale_dtype), layout)

    def _apply(self, fn, recurse: bool = True):
        """Moves and casts apply to the buffers as they are; a move to another kind of device then re-lays
        the weight into the layout that device's kernels read (tile16 on CPUs, lop3 on CUDA GPUs)."""
        result = super()._apply(fn, recurse)
        self.__dict__.pop("_packed", None)  # holds the tensors from before
        target = kernel_layout(self.weight_dtype, self.qweight.device)
        if target is not None and target != self.layout and not self.qweight.is_meta:
            log.info("bitkern: re-laying %s weight from %s to %s for %s", self.weight_dtype, self.layout, target,
                     self.qweight.device)
            self._relayout(target)
        return result

    def _relayout(self, target) -> None:
        """Store the weight again in layout `target` (the kernels of its new device read that one)."""
        self._store(to_layout(self.packed_weight().to_portable(), target))

    def _store_empty(self, layout, device) -> None:
        """Hold an uninitialised weight in `layout` on `device` (meta: shapes only), for a checkpoint to fill."""
        self._store(packed_class(layout).empty(self.weight_format(layout), device))

    def _relaid_tensors(self, tensors: list, source_layout, target) -> list:
        """Op-argument tensors of a weight in `source_layout` (a checkpoint's), given in layout `target`."""
        incoming = library.weight_of(tensors, self.weight_format(source_layout))
        return library.op_arguments(to_layout(incoming.to_portable(), target))[0]

    @property
    def bias_shape(self) -> tuple:
        """The shape of the bias this module adds (one per output)."""
        return (self.gemm_shape[0],)

    def _store(self, weight: PackedWeight) -> None:
        """Hold `weight` as this module's buffers (float metadata as raw bits) and its format as the ops take it."""
        self.layout = weight.layout
        tensors, self._format_text = library.op_arguments(weight)
        for name, tensor in zip(WEIGHT_BUFFERS, tensors):
            self.register_buffer(name, tensor)

    def op_weight(self) -> tuple[list, str]:
        """The stored weight as the (weight, weight_format) arguments of the custom ops (`bitkern.nn.library`)."""
        buffers = self._buffers
        return [buffers[name] for name in WEIGHT_BUFFERS], self._format_text

    def packed_weight(self) -> PackedWeight:
        """The stored weight as a `bitkern.PackedWeight` (views of the buffers, no copy); the same object while the
        buffers are the same tensors, so that what it derives for the kernels is made once."""
        tensors, text = self.op_weight()
        kept = self.__dict__.get("_packed")
        if kept is None or kept[1] is not text or any(a is not b for a, b in zip(kept[0], tensors)):
            kept = self.__dict__["_packed"] = (tensors, text, library.weight_of(tensors, WeightFormat.decode(text)))
        return kept[2]

    def quantized_weight(self) -> QuantizedWeight:
        """The stored weight in the portable layout (`bitkern.QuantizedWeight`)."""
        return self.packed_weight().to_portable()

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight, of `weight_shape`, that this module computes with."""
        return self._from_gemm_matrix(torch.ops.bitkern.dequantize(*self.op_weight(), dtype))

    @property
    def nbytes(self) -> int:
        """Bytes of the stored weight (codes, scales, zeros; the bias not included)."""
        return sum(t.numel() * t.element_size() for t in (getattr(self, n) for n in WEIGHT_BUFFERS) if t is not None)

    def __getattr__(self, name):
        if name == "weight":
            raise AttributeError(
                f"{type(self).__name__} has no float `weight`: it stores it quantized ({self.weight_dtype}) and "
                f"frozen, so there is no weight gradient either. Gradients flow to the input and the bias (train "
                f"adapters such as LoRA on top); use .dequantize_weight() for the float tensor or .dequantize() "
                f"for a float module.")
        return super().__getattr__(name)

    # -- inputs -------------------------------------------------------------------------------------------

    def _compute_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """x in the compute dtype, and the dtype the output is returned in (x's own)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"x has dtype {x.dtype}; {type(self).__name__} takes "
                            f"{', '.join(dtype_name(d) for d in FLOAT_DTYPES)} (convert it explicitly)")
        bias = self._parameters["bias"]  # (the module's own dicts: attribute lookups cost µs per call)
        if bias is not None and tuple(bias.shape) != self.bias_shape:
            raise ValueError(f"bias has shape {tuple(bias.shape)}; {type(self).__name__} with "
                             f"{self.gemm_shape[0]} outputs takes a bias of shape {self.bias_shape}")
        compute = self._compute_dtype or x.dtype
        return (x if x.dtype is compute else x.to(compute)), x.dtype

    # -- state ----------------------------------------------------------------------------------------

    def weight_settings(self) -> dict:
        """What the stored tensors mean: the module's extra state, and a bitkern file's metadata."""
        return {"format": STATE_FORMAT, "class": type(self).__name__, "dtype": self.weight_dtype,
                "group_size": self.group_size, "zero_mode": self.zero_mode, "method": self.method,
                "scale_dtype": dtype_name(self.scale_dtype), "layout": self.layout,
                "weight_shape": list(self.weight_shape),
                "compute_dtype": None if self.compute_dtype is None else dtype_name(self.compute_dtype),
                "activation_quant": self.activation_quant, **self.extra_settings()}

    def extra_settings(self) -> dict:
        """Settings of the module's class that a checkpoint must share (beyond WEIGHT_SETTINGS)."""
        return {}

    def get_extra_state(self) -> dict:
        return self.weight_settings()

    def settings_arguments(self) -> dict:
        """The weight settings as the constructor's and `from_float`'s keyword arguments."""
        return {"dtype": self.weight_dtype, "group_size": self.group_size, "zero_mode": self.zero_mode,
                "method": self.method, "compute_dtype": self.compute_dtype, "scale_dtype": self.scale_dtype,
                "activation_quant": self.activation_quant}

    def state_tensors(self) -> tuple[str, ...]:
        """Names of the tensors of this module's state that a checkpoint holds besides the bias: the weight's
        buffers (and those a subclass adds)."""
        return WEIGHT_BUFFERS

    def check_weight_tensors(self, tensors: dict, layout, where: str = "") -> None:
        """Raise ValueError naming the tensor unless `tensors` ({buffer name: (shape, dtype)} of the weight
        buffers given) are exactly those of this module's weight format in `layout`: the shapes N, K, the group
        size and the type's bits imply there, in their storage dtypes (float metadata also as its raw bits)."""
        weight_format = self.weight_format(layout)
        expected = packed_class(layout).empty(weight_format, "meta")
        n, k = weight_format.shape
        weight = (f"a [{n}, {k}] {self.weight_dtype} weight (group_size={self.group_size}, zero_mode={self.zero_mode}) "
                  f"in layout {weight_format.layout.value!r}")
        for name, want in zip(WEIGHT_BUFFERS, expected.tensors()):
            have = tensors.get(name)
            if want is None and have is not None:
                raise ValueError(f"{where}{name} is given, but {weight} has none")
            if want is not None and have is None:
                raise ValueError(f"{where}{name} is missing; {weight} stores one of shape {list(want.shape)}")
            if want is None:
                continue
            shape, dtype = tuple(have[0]), have[1]
            if shape != tuple(want.shape):
                raise ValueError(f"{where}{name} has shape {list(shape)}, but {weight} stores it as "
                                 f"{list(want.shape)}")
            accepted = (want.dtype, raw_bits(want).dtype)
            if dtype not in accepted:
                raise ValueError(f"{where}{name} has dtype {dtype}, but {weight} stores it as "
                                 f"{' or '.join(str(d) for d in dict.fromkeys(accepted))}")

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """torch's load_state_dict, all or nothing: the state is first loaded into an empty twin of this module
        (on the meta device: tensors are referenced, not copied), so a state that does not fit — other
        settings, missing or unexpected tensors, shapes or dtypes that contradict the settings — raises
        before any tensor of this module changes."""
        twin = type(self)._meta_layer(self, **self.settings_arguments())
        nn.Module.load_state_dict(twin, state_dict, strict, assign=True)
        return super().load_state_dict(state_dict, strict, assign)

    def set_extra_state(self, state) -> None:
        self._check_settings(state)
        self.method = state.get("method", "rtn")  # how the incoming weight was quantized (older states: "rtn")

    def _check_settings(self, state) -> None:
        """Raise naming the setting if `state` describes a weight stored otherwise than this module's."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"the state for this {type(self).__name__} is not a bitkern weight state "
                             f"(format {STATE_FORMAT!r}); got {state!r}")
        mine = self.weight_settings()
        if state.get("class") != mine["class"]:
            raise ValueError(f"the state is of a bitkern.{state.get('class')}, this module is a "
                             f"bitkern.{mine['class']}")
        for key in (*WEIGHT_SETTINGS, *self.extra_settings()):
            if state.get(key) != mine[key]:
                raise ValueError(f"the state was saved with {key}={state.get(key)!r}, but this module has "
                                 f"{key}={mine[key]!r}; build the module with the state's settings (or load "
                                 f"with bitkern.load into a float model, which reads them from the file)")
        method = state.get("method", "rtn")
        if method not in METHODS:
            raise ValueError(f"the state's method={method!r} is not known; accepted: {list(METHODS)}")
        if state.get("layout") not in [layout.value for layout in Layout]:
            raise ValueError(f"the state's layout={state.get('layout')!r} is not known; accepted: "
                             f"{[layout.value for layout in Layout]}")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Check the settings and every incoming weight tensor and the bias before any tensor changes, and
        bring the incoming weight to the layout the kernels for this module's device read (a module on meta
        takes the incoming layout as it is)."""
        state = state_dict.get(prefix + "_extra_state")
        if state is not None:
            self._check_settings(state)
        given = {name: state_dict[prefix + name] for name in WEIGHT_BUFFERS
                 if isinstance(state_dict.get(prefix + name), torch.Tensor)}
        if given:
            layout = self.layout if state is None else state["layout"]
            self.check_weight_tensors({name: (t.shape, t.dtype) for name, t in given.items()}, layout, prefix)
        bias = state_dict.get(prefix + "bias")
        if self.bias is not None and isinstance(bias, torch.Tensor) and tuple(bias.shape) != self.bias_shape:
            raise ValueError(f"{prefix}bias has shape {list(bias.shape)}; this {type(self).__name__} takes a bias "
                             f"of shape {list(self.bias_shape)}")
        for name in given:  # float metadata given as floats is taken as its bits, never converted
            state_dict[prefix + name] = raw_bits(state_dict[prefix + name])
        if state is not None and given:
            source = Layout(state["layout"])
            target = kernel_layout(self.weight_dtype, self.qweight.device) or source
            if target != source:
                log.info("bitkern: re-laying %s weight %s from %s to %s", self.weight_dtype, prefix or "(root)",
                         source, target)
                relaid = self._relaid_tensors([state_dict.get(prefix + name) for name in WEIGHT_BUFFERS], source,
                                              target)
                for name, tensor in zip(WEIGHT_BUFFERS, relaid):
                    if tensor is not None:
                        state_dict[prefix + name] = tensor
            if target != self.layout:  # this module's buffers take the shapes of the incoming layout
                self._store_empty(target, self.qweight.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        with torch.no_grad():  # assigned tensors (e.g. slices of a file) may sit anywhere; kernels need alignment
            for name in (*WEIGHT_BUFFERS, "bias"):
                tensor = getattr(self, name)
                realigned = None if tensor is None else aligned(tensor)
                if realigned is not tensor:
                    setattr(self, name, nn.Parameter(realigned, tensor.requires_grad) if name == "bias" else realigned)

    def _weight_repr(self) -> str:
        float32_bytes = 4 * int(torch.Size(self.weight_shape).numel())
        text = (f"dtype={self.weight_dtype}, group_size={self.group_size}, zero_mode={self.zero_mode}, "
                f"weight={_size(self.nbytes)} (saves {_size(float32_bytes - self.nbytes)}, "
                f"{1 - self.nbytes / float32_bytes:.0%} of float32)")
        text += f", compute_dtype={dtype_name(self.compute_dtype)}" if self.compute_dtype else ""
        return text + (f", activation_quant={self.activation_quant!r}" if self.activation_quant != "none" else "")


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"
