"""The mixed-precision matmul as a typed operator: y[M, N] = x[M, K] · dequant(W)[N, K]ᵀ (+ bias), optionally
preceded by a prologue (x normalized per row: RMSNorm, LayerNorm) and followed by an epilogue (an activation, the
SwiGLU gating of a stacked weight, a residual add).

`Matmul` is a hashable spec (the cache key's operator part); `Matmul.reference` is the pure-torch
result every kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ttype import QuantizedWeight, StoredWeight, dtype_name, effective_group_size, get, torch_dtype
from ..ttype.types import INT, UINT
from . import execution
from ..ttype.quantize import check_zero_mode

ACTIVATION_DTYPES = ("float32", "float16", "bfloat16", "int8", "float8_e4m3")
ACCUMULATE_DTYPES = ("float32", "float16", "int32")
OUTPUT_DTYPES = ("float32", "float16", "bfloat16")
SCALE_DTYPES = ("float16", "bfloat16", "float32")
OPERAND_LAYOUTS = ("nt",)  # the spec's `layout`: x [M, K] row-major times weight [N, K] transposed (nn.Linear's)
# f applied to each z = x·Wᵀ + b in the kernel's output stage; "swiglu" reads a stacked weight (`swiglu_rows`)
EPILOGUES = ("none", "relu", "silu", "gelu", "swiglu")
SWIGLU_BLOCK = 16  # rows of gate, then of up, alternating in a SwiGLU weight (one 16-column tile of each)
# x normalized per row before the GEMM (float32 statistics; `norm_reference` is the definition): "rmsnorm" as
# Hugging Face's LlamaRMSNorm, "torch_rmsnorm" as torch.nn.RMSNorm, "layernorm" as torch.nn.LayerNorm
NORMS = ("none", "rmsnorm", "torch_rmsnorm", "layernorm")
NORM_DTYPES = ("float32", "float16", "bfloat16")  # activation types a norm prologue takes
# x̂ quantized per row before the GEMM ("int8": `quantize_activations` is the definition)
ACTIVATION_QUANTS = ("none", "int8")
ACTIVATION_BLOCK = 32  # consecutive k's sharing one activation scale ("int8": as llama.cpp's Q8_0 blocks)
_SPEC_FIELDS = ("weight_dtype", "activation_dtype", "accumulate_dtype", "output_dtype", "group_size", "zero_mode",
                "bias", "layout", "scale_dtype", "epilogue", "residual", "norm", "norm_eps", "activation_quant")
BIAS_DTYPES = tuple(torch_dtype(name) for name in ("float32", "float16", "bfloat16"))  # added in float32: exact


@dataclass(frozen=True)
class Matmul:
    """Spec of y = x · Wᵀ + b with W stored in `weight_dtype`.

    activation_dtype: type of x; accumulate_dtype: type of the running sums (int32 for int8
    activations × integer weights); output_dtype: type of y (default: the activation type, float32
    for int8 activations); group_size / zero_mode: how W was quantized (see `bitkern.quantize`).
    epilogue: f in y = f(x·Wᵀ + b) (+ r): "none", "relu", "silu", "gelu" (erf), or "swiglu": W is the [2N, K]
    stack of a gate and an up projection whose rows alternate SWIGLU_BLOCK by SWIGLU_BLOCK (`swiglu_rows`;
    the bias likewise) and y[:, j] = silu(gate_j) · up_j has N columns.  residual: a tensor r shaped like y
    (in the output type) is added last.
    norm: x is replaced by its per-row normalization x̂ before the GEMM ("rmsnorm", "torch_rmsnorm",
    "layernorm", see NORMS and `norm_reference`), with a norm weight (and for "layernorm" a norm bias) of K values
    given with each call; norm_eps: the epsilon added to the variance.
    activation_quant: "int8" quantizes x̂ per row and per ACTIVATION_BLOCK consecutive k's to int8 with one float32
    scale each (symmetric, as llama.cpp's Q8_0; `quantize_activations` defines it) and multiplies the integer codes
    of the weight exactly: y = Σ_groups scale · Σ_blocks d · Σ q·code (offsets and zero points folded); for integer
    weight types, and 4-bit code books and floats through their int8 code book (`TType.int8_values`: the codes'
    values on an int8 grid), whose groups hold whole blocks (or per-channel).  "none" multiplies x̂ as it is.
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
    epilogue: str = "none"
    residual: bool = False
    norm: str = "none"
    norm_eps: float = 1e-6
    activation_quant: str = "none"
    geometry = None  # how x's rows are gathered: None for a [M, K] matrix (see `bitkern.ops.Conv2d`)
    experts = 0  # stacked experts that rows are routed to: 0 for one weight (see `bitkern.ops.GroupedMatmul`)

    def __hash__(self) -> int:  # specs key every kernel lookup: hashed once, in __post_init__
        return self._hash

    def __post_init__(self):
        weight = get(self.weight_dtype)
        object.__setattr__(self, "weight_dtype", weight.name)
        activation = _choice("activation_dtype", dtype_name(self.activation_dtype), ACTIVATION_DTYPES)
        object.__setattr__(self, "activation_dtype", activation)
        accumulate = _choice("accumulate_dtype", dtype_name(self.accumulate_dtype), ACCUMULATE_DTYPES)
        object.__setattr__(self, "accumulate_dtype", accumulate)
        default_output = "float32" if activation == "int8" else activation
        output = default_output if self.output_dtype is None else dtype_name(self.output_dtype)
        object.__setattr__(self, "output_dtype", _choice("output_dtype", output, OUTPUT_DTYPES))
        _choice("layout", self.layout, OPERAND_LAYOUTS)
        object.__setattr__(self, "scale_dtype", _choice("scale_dtype", dtype_name(self.scale_dtype), SCALE_DTYPES))
        check_zero_mode(weight, self.zero_mode)
        _choice("epilogue", self.epilogue, EPILOGUES)
        if not isinstance(self.residual, bool):
            raise TypeError(f"residual={self.residual!r} must be a bool")
        _choice("norm", self.norm, NORMS)
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or \
                not 0 < self.norm_eps < float("inf"):
            raise ValueError(f"norm_eps={self.norm_eps!r} must be a positive finite float")
        object.__setattr__(self, "norm_eps", float(self.norm_eps))
        if self.norm != "none" and activation not in NORM_DTYPES:
            raise ValueError(f"norm={self.norm!r} with activation_dtype={activation!r}: a norm prologue takes "
                             f"{list(NORM_DTYPES)} activations")
        _choice("activation_quant", self.activation_quant, ACTIVATION_QUANTS)
        if self.activation_quant != "none":
            self._check_activation_quant(weight, activation)
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
        scale = None if weight.block_size > 1 else self.scale_dtype
        object.__setattr__(self, "_quick", (weight.name, self.zero_mode, scale, torch_dtype(activation)))
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f) for f in _SPEC_FIELDS)))

    def _check_activation_quant(self, weight, activation: str) -> None:
        """Raise naming the field unless the spec's other fields admit quantized activations."""
        quant = f"activation_quant={self.activation_quant!r}"
        if activation not in NORM_DTYPES:
            raise ValueError(f"{quant} quantizes float activations; activation_dtype={activation!r} is not one of "
                             f"{list(NORM_DTYPES)}")
        if weight.kind not in (INT, UINT) and weight.int8_values is None:
            raise ValueError(f"{quant} multiplies integer weight codes, or the int8 code book of a type of at most 4 "
                             f"bits; weight_dtype={weight.name!r} is a {weight.bits}-bit {weight.kind} type (accepted: "
                             f"int and uint types, 4-bit code books and floats such as nf4, fp4_e2m1, mxfp4)")
        if self.geometry is not None:
            raise ValueError(f"{quant} is not supported for convolutions (accepted: 'none')")

    def check_shape(self, n: int, k: int) -> None:
        """Raise unless a [N, K] weight can have this spec (positive sizes, group size dividing K)."""
        if n < 1 or k < 1:
            raise ValueError(f"weight shape ({n}, {k}) must be positive")
        group = effective_group_size(self.group_size, k)
        if k % group:
            raise ValueError(f"group_size={self.group_size} does not divide in_features={k}; accepted: a divisor "
                             f"of {k}, or -1 for per-channel")
        if self.activation_quant != "none" and group != k and group % ACTIVATION_BLOCK:
            raise ValueError(f"activation_quant={self.activation_quant!r} with group_size={self.group_size}: a weight "
                             f"group must hold whole activation blocks of {ACTIVATION_BLOCK}; accepted: a multiple of "
                             f"{ACTIVATION_BLOCK}, or per-channel")
        if self.epilogue == "swiglu" and n % (2 * SWIGLU_BLOCK):
            raise ValueError(f"epilogue='swiglu' needs a stacked weight of a multiple of {2 * SWIGLU_BLOCK} rows "
                             f"(gate and up of a multiple of {SWIGLU_BLOCK} each), got {n}")

    def out_features(self, n: int) -> int:
        """Columns of y for a weight of n rows (half of them for SwiGLU: gate and up make one output)."""
        return n // 2 if self.epilogue == "swiglu" else n

    def rows(self, x: torch.Tensor) -> int:
        """M: the rows of y that a kernel computes for the (already checked, flattened) input x."""
        return x.shape[0]

    def input_shape(self, m: int, k: int) -> tuple:
        """The shape of an input of about m rows, for timing a kernel."""
        return m, k

    def __call__(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                 norm_bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = f(x̂ · Wᵀ (+ bias)) (+ residual) by a compiled kernel; x is [..., K], weight a `bitkern.pack`ed
        weight, x̂ = x or its normalization (norm specs: norm_weight [K], and norm_bias [K] for "layernorm").
        The call goes to the dispatch layer (`bitkern.cache.dispatch`), which checks the inputs with `fits` /
        `check_inputs` and runs the kernel on `gemm_input`."""
        if self.norm == "none" and norm_weight is None and norm_bias is None:
            return execution.run(self, x, weight, bias, residual)
        return execution.run(self, x, weight, bias, residual, norm_weight, norm_bias)

    def fits(self, x, weight, bias, residual=None, norm_weight=None, norm_bias=None) -> bool:
        """A quick test (a few comparisons) that implies `check_inputs` passes for CPU tensors; False sends the
        call through `check_inputs`, which names what is wrong.  Right after a kernel has streamed its weights
        through the caches, the full checks cost ~20 µs per call (measured at 4096x4096, M=1)."""
        name, zero_mode, scale, activation = self._quick
        weight_format = weight.format
        n, k = weight_format.shape
        return (weight_format.dtype == name and weight_format.zero_mode == zero_mode
                and weight_format.group_size == effective_group_size(self.group_size, k)
                and (scale is None or weight_format.scale_dtype == scale)
                and type(x) is torch.Tensor and x.dtype is activation and x.dim() >= 1 and x.shape[-1] == k
                and x.is_cpu and weight.qweight.is_cpu
                and (bias is None if not self.bias else
                     type(bias) is torch.Tensor and tuple(bias.shape) == (n,) and bias.is_cpu
                     and bias.dtype in BIAS_DTYPES)
                and (residual is None if not self.residual else
                     type(residual) is torch.Tensor and residual.shape[:-1] == x.shape[:-1]
                     and residual.shape[-1] == self.out_features(n) and residual.is_contiguous()
                     and residual.dtype is torch_dtype(self.output_dtype) and residual.is_cpu)
                and (norm_weight is None and norm_bias is None if self.norm == "none" else
                     _norm_vector_fits(norm_weight, k) and
                     (_norm_vector_fits(norm_bias, k) if self.norm == "layernorm" else norm_bias is None)))

    def gemm_input(self, x: torch.Tensor, n: int, k: int, gathered: bool = True) -> tuple:
        """(the spec whose kernel runs, its contiguous [M, K] rows, the shape of y) for a checked x (`gathered`:
        whether the kernel gathers a convolution's rows itself, see `Conv2d`).  A contiguous [M, K] x goes to
        the kernel as it is: right after a kernel has streamed its weights through the caches, each torch op of
        a call costs microseconds (measured: reshape + contiguous + reshape add ~15-25 µs to a 4096x4096 GEMV)."""
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, k).contiguous()
        return self, rows, (*x.shape[:-1], self.out_features(n))

    def check_inputs(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                     norm_bias: torch.Tensor | None = None) -> None:
        """Raise naming the argument if x, weight (quantized or packed), bias, residual or the norm's weight and
        bias do not fit this spec."""
        if not isinstance(weight, StoredWeight):
            raise TypeError(f"weight must be a bitkern QuantizedWeight, got {type(weight).__name__}")
        n, k = weight.shape
        expected_group = effective_group_size(self.group_size, k)
        scale_dtype = self.scale_dtype if weight.ttype.block_size == 1 else "float16"
        have_scale = dtype_name(weight.scales.dtype) if weight.ttype.block_size == 1 else "float16"
        for field, have, want in (("weight_dtype", weight.ttype.name, self.weight_dtype),
                                  ("group_size", weight.group_size, expected_group),
                                  ("zero_mode", weight.zero_mode, self.zero_mode),
                                  ("scale_dtype", have_scale, scale_dtype)):
            if have != want:
                raise ValueError(f"weight has {field}={have!r} but the Matmul spec has {field}={want!r}")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch_dtype(self.activation_dtype):
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
        self.check_shape(n, k)
        if self.residual != (residual is not None):
            raise ValueError(f"residual {'is required' if self.residual else 'must be None'}: the spec has "
                             f"residual={self.residual}")
        if residual is not None:
            shape = (*x.shape[:-1], self.out_features(n))
            if not isinstance(residual, torch.Tensor) or tuple(residual.shape) != shape:
                got = tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
                raise ValueError(f"residual must be a tensor of shape {shape}, got {got}")
            if residual.dtype != torch_dtype(self.output_dtype) or residual.device != weight.device:
                raise ValueError(f"residual must be a {self.output_dtype} tensor on {weight.device}, got "
                                 f"{residual.dtype} on {residual.device}")
        self._check_norm_inputs(k, weight.device, norm_weight, norm_bias)

    def _check_norm_inputs(self, k: int, device, norm_weight, norm_bias) -> None:
        """Raise naming the argument unless the norm's weight (and bias) are what the spec's norm takes."""
        wanted = {"none": (), "rmsnorm": ("norm_weight",), "torch_rmsnorm": ("norm_weight",),
                  "layernorm": ("norm_weight", "norm_bias")}[self.norm]
        for name, value in (("norm_weight", norm_weight), ("norm_bias", norm_bias)):
            if name not in wanted:
                if value is not None:
                    raise ValueError(f"{name} must be None: the spec has norm={self.norm!r}")
                continue
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (k,):
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{name} must be a tensor of shape ({k},) (in_features) for norm={self.norm!r}, "
                                 f"got {got}")
            if value.dtype not in BIAS_DTYPES or value.device != device:
                raise ValueError(f"{name} must be a float32, float16 or bfloat16 tensor on {device}, got "
                                 f"{value.dtype} on {value.device}")

    def reference(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                  norm_bias: torch.Tensor | None = None) -> torch.Tensor:
        """The reference result: `exact` cast to the output type."""
        return self.exact(x, weight, bias, residual, norm_weight, norm_bias).to(torch_dtype(self.output_dtype))

    def exact(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
              norm_bias: torch.Tensor | None = None) -> torch.Tensor:
        """The result in float64 before output rounding (x normalized by `norm_reference`, dequantized weight,
        float64 sums, torch's activations)."""
        self.check_inputs(x, weight, bias, residual, norm_weight, norm_bias)
        x = norm_reference(self.norm, x, norm_weight, norm_bias, self.norm_eps)
        x = quantize_activations(x) if self.activation_quant == "int8" else x.double()
        y = x @ self.weight_values(weight).T
        y = y + bias.double() if bias is not None else y
        y = epilogue_reference(self.epilogue, y)
        return y + residual.double() if residual is not None else y

    def weight_values(self, weight) -> torch.Tensor:
        """The float64 [N, K] weight the spec multiplies: the dequantized weight, with the type's int8 code book
        (`TType.int8_values`) for activation_quant="int8"."""
        portable = weight.to_portable()
        table = portable.ttype.int8_values if self.activation_quant == "int8" else None
        values = None if table is None else table[0].double() * table[1]
        return portable.dequantize(torch.float64, values)

    @classmethod
    def for_weight(cls, weight: QuantizedWeight, activation_dtype="float16", bias: bool = False, **options) -> "Matmul":
        """The spec that fits a quantized weight (its type, group size and zero mode)."""
        scale_dtype = dtype_name(weight.scales.dtype) if weight.ttype.block_size == 1 else "float16"
        return cls(weight.ttype.name, activation_dtype, group_size=weight.group_size, zero_mode=weight.zero_mode,
                   bias=bias, scale_dtype=scale_dtype, **options)


def swiglu_rows(n: int) -> torch.Tensor:
    """The row order that stacks a gate and an up weight of n rows each ([gate; up], 2n rows) for
    epilogue="swiglu": SWIGLU_BLOCK gate rows, then the same SWIGLU_BLOCK up rows, and so on."""
    if n % SWIGLU_BLOCK:
        raise ValueError(f"SwiGLU gate and up projections need a multiple of {SWIGLU_BLOCK} rows, got {n}")
    blocks = torch.arange(n).reshape(-1, SWIGLU_BLOCK)
    return torch.stack((blocks, blocks + n), dim=1).reshape(-1)


def norm_reference(norm: str, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    """x̂ of a norm prologue in torch, in x's dtype (statistics in float32 over the last dimension, the population
    variance): "rmsnorm" is Hugging Face's LlamaRMSNorm, weight · dtype(x·rstd) rounded to x's dtype;
    "torch_rmsnorm" torch.rms_norm, dtype(x·rstd·weight); "layernorm" torch's layer_norm, dtype((x·rstd -
    mean·rstd)·weight + bias); rstd = 1/sqrt(variance + eps).  Differentiable (the backward of the fused op)."""
    if norm == "none":
        return x
    dtype, value = x.dtype, x.float()
    if norm == "layernorm":
        mean = value.mean(-1, keepdim=True)
        rstd = torch.rsqrt((value - mean).square().mean(-1, keepdim=True) + eps)
        return ((value * rstd - mean * rstd) * weight.float() + bias.float()).to(dtype)
    rstd = torch.rsqrt(value.square().mean(-1, keepdim=True) + eps)
    if norm == "rmsnorm":
        return (weight.float() * (value * rstd).to(dtype).float()).to(dtype)
    return (value * rstd * weight.float()).to(dtype)


def activation_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, d) of activation_quant="int8": x's last dimension zero-padded to whole blocks of ACTIVATION_BLOCK, each
    block's finite values v (±Inf and NaN count as 0 here) as int8 codes q = round-half-even(v / d), clamped to
    ±127, with the float32 scale d = absmax(v) / 127 (a block of zeros: d = 0, q = 0).  q: int8 [..., blocks,
    ACTIVATION_BLOCK]; d: float32 [..., blocks]."""
    values = x.float()
    values = torch.where(torch.isfinite(values), values, 0.0)
    values = F.pad(values, (0, -values.shape[-1] % ACTIVATION_BLOCK))
    values = values.reshape(*values.shape[:-1], -1, ACTIVATION_BLOCK)
    d = values.abs().amax(-1) / 127
    ratio = torch.where(d[..., None] > 0, values / d[..., None], 0.0)
    return torch.round(ratio).clamp(-127, 127).to(torch.int8), d


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x as activation_quant="int8" computes with it, in float64: d·q of `activation_blocks` (exact), with x's
    non-finite values kept as they are (their products give torch's ±Inf and NaN)."""
    q, d = activation_blocks(x)
    values = (q.double() * d.double()[..., None]).flatten(-2)[..., :x.shape[-1]]
    return torch.where(torch.isfinite(x), values, x.double())


def _norm_vector_fits(value, k: int) -> bool:
    """A quick test that a norm weight or bias passes `Matmul.check_inputs`."""
    return type(value) is torch.Tensor and value.dim() == 1 and value.shape[0] == k and value.is_cpu \
        and value.dtype in BIAS_DTYPES


def epilogue_reference(epilogue: str, z: torch.Tensor) -> torch.Tensor:
    """f(z) of an epilogue in torch (z: the [..., N] sums with bias; SwiGLU's in `swiglu_rows` order)."""
    if epilogue == "swiglu":
        pairs = z.reshape(*z.shape[:-1], -1, 2, SWIGLU_BLOCK)
        return (F.silu(pairs[..., 0, :]) * pairs[..., 1, :]).reshape(*z.shape[:-1], -1)
    functions = {"none": lambda v: v, "relu": F.relu, "silu": F.silu, "gelu": F.gelu}
    return functions[epilogue](z)


def _choice(argument: str, value, accepted: tuple):
    if value not in accepted:
        raise ValueError(f"{argument}={value!r} is not supported; accepted: {list(accepted)}")
    return value
