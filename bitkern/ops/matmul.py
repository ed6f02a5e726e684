"""The mixed-precision matmul as a typed operator: y[M, N] = x[M, K] · dequant(W)[N, K]ᵀ (+ bias).

`Matmul` is a hashable spec (the cache key's operator part); `Matmul.reference` is the pure-torch
result every kernel is tested against.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..ttype import QuantizedWeight, get
from ..ttype.quantize import check_zero_mode
from ..ttype.types import COMPUTE_DTYPES, check_compute_dtype

ACTIVATION_DTYPES = ("float32", "float16", "bfloat16", "int8", "float8_e4m3")
ACCUMULATE_DTYPES = ("float32", "float16", "int32")
OUTPUT_DTYPES = ("float32", "float16", "bfloat16")
SCALE_DTYPES = ("float16", "bfloat16", "float32")
LAYOUTS = ("nt",)  # x [M, K] row-major, weight [N, K] (nn.Linear's layout)
_SPEC_FIELDS = ("weight_dtype", "activation_dtype", "accumulate_dtype", "output_dtype", "group_size", "zero_mode",
                "bias", "layout", "scale_dtype")
_TORCH_DTYPES = {**{name: pair[0] for name, pair in COMPUTE_DTYPES.items()}, "int32": torch.int32}
BIAS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # added in float32: exact


@dataclass(frozen=True)
class Matmul:
    """Spec of y = x · Wᵀ + b with W stored in `weight_dtype`.

    activation_dtype: type of x; accumulate_dtype: type of the running sums (int32 for int8
    activations × integer weights); output_dtype: type of y (default: the activation type, float32
    for int8 activations); group_size / zero_mode: how W was quantized (see `bitkern.quantize`).
    """

    weight_dtype: str
    activation_dtype: str = "float16"
    accumulate_dtype: str = "float32"
    output_dtype: str | None = None
    group_size: int = 128
    zero_mode: str = "none"
    bias: bool = False
    layout: str = "nt"
    scale_dtype: str = "float16"
    geometry = None  # how x's rows are gathered: None for a [M, K] matrix (see `bitkern.ops.Conv2d`)

    def __hash__(self) -> int:  # specs key every kernel lookup: hashed once, in __post_init__
        return self._hash

    def __post_init__(self):
        weight = get(self.weight_dtype)
        object.__setattr__(self, "weight_dtype", weight.name)
        activation = _choice("activation_dtype", _dtype_name(self.activation_dtype), ACTIVATION_DTYPES)
        object.__setattr__(self, "activation_dtype", activation)
        accumulate = _choice("accumulate_dtype", _dtype_name(self.accumulate_dtype), ACCUMULATE_DTYPES)
        object.__setattr__(self, "accumulate_dtype", accumulate)
        default_output = "float32" if activation == "int8" else activation
        output = default_output if self.output_dtype is None else _dtype_name(self.output_dtype)
        object.__setattr__(self, "output_dtype", _choice("output_dtype", output, OUTPUT_DTYPES))
        _choice("layout", self.layout, LAYOUTS)
        object.__setattr__(self, "scale_dtype", _choice("scale_dtype", _dtype_name(self.scale_dtype), SCALE_DTYPES))
        check_zero_mode(weight, self.zero_mode)
        if weight.block_size > 1 and self.group_size != weight.block_size:
            raise ValueError(f"group_size={self.group_size}: type {weight.name!r} has a fixed block; "
                             f"accepted: {weight.block_size}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or \
                (self.group_size < 1 and self.group_size != -1):
            raise ValueError(f"group_size={self.group_size!r} must be a positive int or -1 (per-channel)")
        if (activation == "int8") != (accumulate == "int32"):
            raise ValueError(f"accumulate_dtype={accumulate!r} with activation_dtype={activation!r}: int8 "
                             f"activations accumulate in int32, float activations in float32 or float16")
        if activation == "int8" and "int8" not in weight.compute_types:
            raise ValueError(f"activation_dtype='int8' needs a weight type that converts to int8 exactly; "
                             f"{weight.name!r} converts to {list(weight.compute_types)}")
        scale = None if weight.block_size > 1 else _TORCH_DTYPES[self.scale_dtype]
        object.__setattr__(self, "_quick", (weight.name, self.zero_mode, scale, _TORCH_DTYPES[activation]))
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f) for f in _SPEC_FIELDS)))

    def check_shape(self, n: int, k: int) -> None:
        """Raise unless a [N, K] weight can have this spec (positive sizes, group size dividing K)."""
        if n < 1 or k < 1:
            raise ValueError(f"weight shape ({n}, {k}) must be positive")
        group = k if self.group_size == -1 else self.group_size
        if k % group:
            raise ValueError(f"group_size={self.group_size} does not divide in_features={k}; accepted: a divisor "
                             f"of {k}, or -1 for per-channel")

    def rows(self, x: torch.Tensor) -> int:
        """M: the rows of y that a kernel computes for the (already checked, flattened) input x."""
        return x.shape[0]

    def input_shape(self, m: int, k: int) -> tuple:
        """The shape of an input of about m rows, for timing a kernel."""
        return m, k

    def __call__(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x · Wᵀ (+ bias) by a compiled kernel; x is [..., K], weight a `bitkern.pack`ed weight."""
        kernel_for, PackedWeight = _pipeline()
        if not isinstance(weight, PackedWeight):
            raise TypeError(f"weight must be packed for the kernels with bitkern.pack(quantized_weight), "
                            f"got {type(weight).__name__}")
        quick = self._fits(x, weight, bias)
        if not quick:
            self.check_inputs(x, weight, bias)
        n, k = weight.shape
        spec, data, shape = self._kernel_input(x, n, k)
        if data.shape[0] == 0:
            return torch.empty(shape, dtype=_TORCH_DTYPES[self.output_dtype], device=x.device)
        kernel = kernel_for(spec, n, k, spec.rows(data), weight.layout, None if quick else _device_of(x))
        y = kernel(data, weight, bias)
        return y if y.shape == shape else y.reshape(shape)

    def _fits(self, x, weight, bias) -> bool:
        """A quick test (a few comparisons) that implies `check_inputs` passes for CPU tensors; False sends the
        call through `check_inputs`, which names what is wrong.  Right after a kernel has streamed its weights
        through the caches, the full checks cost ~20 µs per call (measured at 4096x4096, M=1)."""
        name, zero_mode, scale, activation = self._quick
        n, k = weight.shape
        return (weight.ttype.name == name and weight.zero_mode == zero_mode
                and weight.group_size == (k if self.group_size == -1 else self.group_size)
                and (scale is None or weight.scales.dtype is scale)
                and type(x) is torch.Tensor and x.dtype is activation and x.dim() >= 1 and x.shape[-1] == k
                and x.is_cpu and weight.qweight.is_cpu
                and (bias is None if not self.bias else
                     type(bias) is torch.Tensor and tuple(bias.shape) == (n,) and bias.is_cpu
                     and bias.dtype in BIAS_DTYPES))

    def _kernel_input(self, x: torch.Tensor, n: int, k: int) -> tuple:
        """(the spec whose kernel runs, its contiguous input, the shape of y) for a checked x.  A contiguous
        [M, K] x goes to the kernel as it is: right after a kernel has streamed its weights through the caches,
        each torch op of a call costs microseconds (measured: reshape + contiguous + reshape add ~15-25 µs to
        a 4096x4096 GEMV)."""
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
        return self, rows, (*x.shape[:-1], n)

    def check_inputs(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> None:
        """Raise naming the argument if x, weight (quantized or packed) or bias do not fit this spec."""
        if not isinstance(weight, (QuantizedWeight, _pipeline()[1])):
            raise TypeError(f"weight must be a bitkern QuantizedWeight, got {type(weight).__name__}")
        n, k = weight.shape
        expected_group = k if self.group_size == -1 else self.group_size
        scale_dtype = self.scale_dtype if weight.ttype.block_size == 1 else "float16"
        have_scale = _dtype_name(weight.scales.dtype) if weight.ttype.block_size == 1 else "float16"
        for field, have, want in (("weight_dtype", weight.ttype.name, self.weight_dtype),
                                  ("group_size", weight.group_size, expected_group),
                                  ("zero_mode", weight.zero_mode, self.zero_mode),
                                  ("scale_dtype", have_scale, scale_dtype)):
            if have != want:
                raise ValueError(f"weight has {field}={have!r} but the Matmul spec has {field}={want!r}")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != _TORCH_DTYPES[self.activation_dtype]:
            raise TypeError(f"x has dtype {x.dtype}; this Matmul takes activation_dtype={self.activation_dtype}")
        if x.dim() < 1 or x.shape[-1] != k:
            raise ValueError(f"x has shape {tuple(x.shape)}; its last dimension must be in_features={k}")
        if x.device != weight.device:
            raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
        if self.bias != (bias is not None):
            raise ValueError(f"bias {'is required' if self.bias else 'must be None'}: the spec has bias={self.bias}")
        if bias is not None:
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,):
                got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
                raise ValueError(f"bias must be a tensor of shape ({n},), got {got}")
            if bias.device != weight.device:
                raise ValueError(f"bias is on {bias.device} but weight is on {weight.device}")
            if bias.dtype not in BIAS_DTYPES:
                raise TypeError(f"bias has dtype {bias.dtype}; the kernels add a float32, float16 or bfloat16 bias "
                                f"(exactly, in float32) and cast none silently: convert it explicitly")

    def reference(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The reference result: `exact` cast to the output type."""
        return self.exact(x, weight, bias).to(_TORCH_DTYPES[self.output_dtype])

    def exact(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The result in float64 before output rounding (dequantized weight, float64 sums)."""
        self.check_inputs(x, weight, bias)
        if not isinstance(weight, QuantizedWeight):
            weight = weight.to_portable()
        y = x.double() @ weight.dequantize(torch.float64).T
        return y + bias.double() if bias is not None else y

    @classmethod
    def for_weight(cls, weight: QuantizedWeight, activation_dtype="float16", bias: bool = False, **options) -> "Matmul":
        """The spec that fits a quantized weight (its type, group size and zero mode)."""
        scale_dtype = _dtype_name(weight.scales.dtype) if weight.ttype.block_size == 1 else "float16"
        return cls(weight.ttype.name, activation_dtype, group_size=weight.group_size, zero_mode=weight.zero_mode,
                   bias=bias, scale_dtype=scale_dtype, **options)


def _device_of(x: torch.Tensor):
    """The tuner's description of the device x lives on (None: the host CPU)."""
    if x.device.type == "cpu":
        return None
    if x.device.type == "cuda":
        from ..tuner.device import cuda_device

        return cuda_device()
    raise NotImplementedError(f"bitkern has kernels for cpu and cuda tensors, not {x.device.type}")


@functools.lru_cache(maxsize=None)
def _pipeline():
    """The kernel lookup and the packed-weight type: ops sits below the kernel pipeline, so it reaches
    them at call time (once)."""
    from ..cache import kernel_for
    from ..codegen import PackedWeight

    return kernel_for, PackedWeight


def _dtype_name(dtype):
    """A bitkern dtype name for a torch dtype or name (int32 included for accumulators)."""
    if dtype is torch.int32 or dtype == "int32":
        return "int32"
    try:
        return check_compute_dtype(dtype)
    except ValueError:
        return dtype


def _choice(argument: str, value, accepted: tuple):
    if value not in accepted:
        raise ValueError(f"{argument}={value!r} is not supported; accepted: {list(accepted)}")
    return value
