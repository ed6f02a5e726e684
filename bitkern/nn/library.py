"""bitkern's kernels as torch custom ops (torch.library), so torch.compile traces them without graph breaks.

`torch.ops.bitkern.linear` runs y = x · dequant(W)ᵀ + b through `bitkern.ops.Matmul`,
`torch.ops.bitkern.linear_epilogue` the same with an epilogue in the kernel's output stage (activation, SwiGLU
gating, residual add) and optionally a norm prologue (RMSNorm, LayerNorm of x per row): what `bitkern.fusion`
fuses, and
`torch.ops.bitkern.conv2d` the implicit-GEMM convolution of a channels-last image through
`bitkern.ops.Conv2d`; their fake implementations give the output's shape and dtype, and their autograd
formulas send gradients to x and the bias only (the quantized weight is frozen).
`torch.ops.bitkern.grouped_linear` is a mixture-of-experts projection of rows routed to their top-k experts
through `bitkern.ops.GroupedMatmul` (SwiGLU and the weighted top-k sum optionally in its output stage), and
`torch.ops.bitkern.expert_blocks` one of rows sorted by expert, counted per expert by a tensor (a prompt's, inside a
compiled graph; both inference only: no autograd formula).
`torch.ops.bitkern.dequantize` gives the float weight.

A weight crosses an op's boundary as two arguments (torch.library ops take plain values only): `weight`, its
tensors in `StoredWeight.TENSORS` order (qweight, scales, zeros, tensor_scale; None where the format has none;
float metadata as raw bits, same-width integers, so module-wide casts never round it), and `weight_format`, its
`WeightFormat` as a string.  `op_arguments` and `weight_of` are the one place that converts between the two.

The ops are defined by `bitkern.nn.dispatcher.op`, whose plain calls run the body at once: a call from a compiled
graph costs ~8 µs more than its body (`torch.library.custom_op`: ~17; M=1, Zen 4).  A module called for inference
in eager mode skips even that (`eager`): it runs `run_linear`, the op's own body, on the weight object it keeps,
without the dispatcher's argument conversion, which a decode step would pay for every layer.  Either way a CPU call
whose signature an earlier call had runs the kernel bound to it (`bitkern.cache.bound`), past the checks and the
lookup: a tiny linear op 52 -> 30 µs a call, a grouped one 89 -> 52 (M=1, Zen 3).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..cache.bound import described
from ..cache.dispatch import bound_call, run, run_bound, run_grouped, run_grouped_bound
from ..codegen import PackedWeight, packed_class
from ..ops import Conv2d, ConvGeometry, GroupedMatmul, Matmul
from ..ops.conv import conv_weight, out_size
from ..ops.matmul import epilogue_reference, norm_reference
from ..ttype import StoredWeight, WeightFormat, get, torch_dtype
from .dispatcher import op

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_RAW_BITS = {2: torch.int16, 4: torch.int32}  # integer dtype of each float width


def op_arguments(weight: StoredWeight) -> tuple[list, str]:
    """(weight, weight_format): the op arguments of a stored weight."""
    return [raw_bits(tensor) for tensor in weight.tensors()], weight.format.encode()


def weight_of(tensors: list, weight_format: WeightFormat) -> PackedWeight:
    """The weight that op arguments describe: its format, and its tensors with float metadata viewed back from
    their raw bits (views, no copies)."""
    qweight, scales, zeros, tensor_scale = tensors
    floats = (_float_view(scales, weight_format.scale_dtype), _float_view(zeros, weight_format.zero_dtype),
              _float_view(tensor_scale, "float32"))
    return packed_class(weight_format.layout).from_format(weight_format, qweight, *floats)


def raw_bits(tensor: Tensor | None) -> Tensor | None:
    """A float tensor as same-width integers (how float metadata is stored and crosses the ops); others as they
    are."""
    if tensor is None or not tensor.is_floating_point():
        return tensor
    return tensor.view(_RAW_BITS[tensor.element_size()])


def _float_view(bits: Optional[Tensor], dtype: str | None) -> Optional[Tensor]:
    """The float tensor of `dtype` stored as raw bits; uint8 codes (and None) stay as they are."""
    if bits is None or bits.dtype == torch.uint8:
        return bits
    return bits.view(torch_dtype(dtype))


@functools.lru_cache(maxsize=None)
def spec_of(weight_format: str, activation: torch.dtype, output: torch.dtype, bias: bool,
            geometry: ConvGeometry | None = None, epilogue: str = "none", residual: bool = False,
            norm: str = "none", norm_eps: float = 1e-6, activation_quant: str = "none") -> Matmul:
    """The Matmul spec of an op call (a Conv2d spec when a convolution `geometry` is given); `bitkern.fusion`
    prices fused calls by it."""
    described = WeightFormat.decode(weight_format)
    fields = _spec_fields(described, output, bias)
    if geometry is not None:
        return Conv2d(described.dtype, activation, geometry=geometry, **fields)
    return Matmul(described.dtype, activation, epilogue=epilogue, residual=residual, norm=norm, norm_eps=norm_eps,
                  activation_quant=activation_quant, **fields)


def _spec_fields(described: WeightFormat, output: torch.dtype, bias: bool) -> dict:
    """The spec fields a weight format and an op call's output and bias give (block types keep float16 scales in
    their spec, whatever they store)."""
    block = get(described.dtype).block_size > 1
    return dict(output_dtype=output, group_size=described.group_size, zero_mode=described.zero_mode, bias=bias,
                scale_dtype="float16" if block else described.scale_dtype)


def _weight(weight: list, weight_format: str) -> PackedWeight:
    return weight_of(weight, WeightFormat.decode(weight_format))


def _tensors(weight: PackedWeight | list) -> tuple | list:
    """The tensors a weight object or an op's weight argument holds, qweight first."""
    return weight.tensors() if isinstance(weight, PackedWeight) else weight


def _packed(weight: PackedWeight | list, weight_format: str) -> PackedWeight:
    """A weight object, or the one an op's weight tensors make."""
    return weight if isinstance(weight, PackedWeight) else _weight(weight, weight_format)


def eager(x: Tensor, bias: Tensor | None) -> bool:
    """Whether a module's call may run its op's body directly: plain tensors in eager mode with nothing to record
    for autograd, and nothing that must see the op (torch.compile, export, the JIT tracer, a dispatch mode or a
    tensor subclass)."""
    return (type(x) is Tensor and not torch.compiler.is_compiling() and not torch.jit.is_tracing()
            and not (torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)))
            and not torch._C._len_torch_dispatch_stack())


def run_linear(x: Tensor, weight: PackedWeight | list, weight_format: str, bias: Optional[Tensor],
               output_dtype: torch.dtype, activation_quant: str = "none") -> Tensor:
    """The linear op's computation on a weight object or the op's weight tensors (its `weight_format` string as
    the op takes it): `run_linear_epilogue`'s without an epilogue, residual or norm (the same spec)."""
    return run_linear_epilogue(x, weight, weight_format, bias, output_dtype, "none", None,
                               activation_quant=activation_quant)


@op("linear")
def linear(x: Tensor, weight: list[Optional[Tensor]], weight_format: str, bias: Optional[Tensor],
           output_dtype: torch.dtype, activation_quant: str = "none") -> Tensor:
    """y[..., N] = x[..., K] · dequant(W)ᵀ (+ bias), computed in x's dtype (quantized by `activation_quant`, a
    `bitkern.ops.Matmul` activation quantization), returned in `output_dtype`."""
    return run_linear(x, weight, weight_format, bias, output_dtype, activation_quant)


@linear.register_fake
def _linear_fake(x, weight, weight_format, bias, output_dtype, activation_quant="none"):
    out_features = WeightFormat.decode(weight_format).shape[0]
    return x.new_empty((*x.shape[:-1], out_features), dtype=output_dtype)


@op("linear_epilogue")
def linear_epilogue(x: Tensor, weight: list[Optional[Tensor]], weight_format: str, bias: Optional[Tensor],
                    output_dtype: torch.dtype, epilogue: str, residual: Optional[Tensor], norm: str = "none",
                    norm_weight: Optional[Tensor] = None, norm_bias: Optional[Tensor] = None,
                    norm_eps: float = 1e-6, activation_quant: str = "none") -> Tensor:
    """y = f(x̂ · dequant(W)ᵀ (+ bias)) (+ residual) in one kernel: f a `bitkern.ops.Matmul` epilogue ("relu",
    "silu", "gelu", or "swiglu" over a stacked gate/up weight, giving half its rows as columns); the residual
    is shaped like y, in `output_dtype`; x̂ = x, or x normalized per row by the norm prologue `norm` ("rmsnorm":
    Hugging Face's LlamaRMSNorm, "torch_rmsnorm", "layernorm") with norm_weight [K] (and norm_bias [K] for
    "layernorm") and norm_eps; x̂ quantized by `activation_quant` as in `linear`."""
    return run_linear_epilogue(x, weight, weight_format, bias, output_dtype, epilogue, residual, norm, norm_weight,
                               norm_bias, norm_eps, activation_quant)


def run_linear_epilogue(x: Tensor, weight: PackedWeight | list, weight_format: str, bias: Optional[Tensor],
                        output_dtype: torch.dtype, epilogue: str, residual: Optional[Tensor], norm: str = "none",
                        norm_weight: Optional[Tensor] = None, norm_bias: Optional[Tensor] = None,
                        norm_eps: float = 1e-6, activation_quant: str = "none") -> Tensor:
    """The linear_epilogue op's computation on a weight object or the op's weight tensors (what fused modules run
    in eager inference, as `run_linear` for Linear): a call of a signature seen before by the kernel bound to it
    (`bitkern.cache.bound`)."""
    tensors = _tensors(weight)
    signature = ("linear_epilogue", weight_format, described(x), described(bias), output_dtype, epilogue,
                 described(residual), norm, described(norm_weight), described(norm_bias), norm_eps, activation_quant)
    call = bound_call(tensors, signature)
    if call is not None:
        return run_bound(call, x, tensors[0], bias, residual, norm_weight, norm_bias)
    spec = spec_of(weight_format, x.dtype, output_dtype, bias is not None, None, epilogue, residual is not None,
                   norm, norm_eps, activation_quant)
    return run(spec, x, _packed(weight, weight_format), bias, residual, norm_weight, norm_bias,
               bind=(tensors, signature))


@linear_epilogue.register_fake
def _linear_epilogue_fake(x, weight, weight_format, bias, output_dtype, epilogue, residual, norm="none",
                          norm_weight=None, norm_bias=None, norm_eps=1e-6, activation_quant="none"):
    out_features = WeightFormat.decode(weight_format).shape[0] // (2 if epilogue == "swiglu" else 1)
    return x.new_empty((*x.shape[:-1], out_features), dtype=output_dtype)


@functools.lru_cache(maxsize=None)
def grouped_spec_of(weight_format: str, activation: torch.dtype, output: torch.dtype, bias: bool, experts: int,
                    top_k: int, activation_quant: str = "none", epilogue: str = "none",
                    combine: bool = False) -> GroupedMatmul:
    """The GroupedMatmul spec of a grouped_linear call (weight_format: the experts' stacked [E·N, K] weight's)."""
    described = WeightFormat.decode(weight_format)
    return GroupedMatmul(described.dtype, activation, experts=experts, top_k=top_k, activation_quant=activation_quant,
                         epilogue=epilogue, combine=combine, **_spec_fields(described, output, bias))


def run_grouped_linear(x: Tensor, weight: PackedWeight | list, weight_format: str, indices: Tensor,
                       bias: Optional[Tensor], output_dtype: torch.dtype, experts: int, activation_quant: str = "none",
                       checked: bool = False, epilogue: str = "none", weights: Optional[Tensor] = None) -> Tensor:
    """The grouped_linear op's computation on the stacked weight object or the op's weight tensors (what
    `bitkern.Experts` runs in eager inference, as `run_linear` for Linear; `checked`: its caller has checked x, the
    routing and the bias, as `bitkern.Experts` does once per call for both projections)."""
    tensors = _tensors(weight)
    signature = ("grouped_linear", weight_format, described(x), described(indices), described(bias), output_dtype,
                 experts, activation_quant, epilogue, described(weights))
    call = bound_call(tensors, signature)
    if call is not None:
        return run_grouped_bound(call, x, tensors[0], indices, bias, weights)
    spec = grouped_spec_of(weight_format, x.dtype, output_dtype, bias is not None, experts, indices.shape[-1],
                           activation_quant, epilogue, weights is not None)
    return run_grouped(spec, x, _packed(weight, weight_format), indices, bias, weights, checked,
                       bind=(tensors, signature))


@op("grouped_linear")
def grouped_linear(x: Tensor, weight: list[Optional[Tensor]], weight_format: str, indices: Tensor,
                   bias: Optional[Tensor], output_dtype: torch.dtype, experts: int,
                   activation_quant: str = "none", epilogue: str = "none",
                   weights: Optional[Tensor] = None) -> Tensor:
    """y[m, j] = f(x[m] · dequant(W[indices[m, j]])ᵀ (+ bias[indices[m, j]])): y [M, top_k, N'] of x [M, K], the
    `experts` stacked [N, K] weights as one [E·N, K] weight, indices [M, top_k] (int32/int64 expert ids), bias
    [E, N] or None, computed in x's dtype (quantized by `activation_quant`, as in `linear`), returned in
    `output_dtype`; f: `epilogue` "none" or "swiglu" (each expert's rows [gate; up], N' = N/2).  With the routing
    `weights` [M, top_k], x holds a row per (m, j) pair ([M·top_k, K]) and y [M, N'] = Σ_j weights[m, j] · y[m, j]
    (`bitkern.ops.GroupedMatmul`, combine=True).  Inference only: no autograd formula."""
    return run_grouped_linear(x, weight, weight_format, indices, bias, output_dtype, experts, activation_quant,
                              epilogue=epilogue, weights=weights)


@grouped_linear.register_fake
def _grouped_linear_fake(x, weight, weight_format, indices, bias, output_dtype, experts, activation_quant="none",
                         epilogue="none", weights=None):
    out_features = WeightFormat.decode(weight_format).shape[0] // experts // (2 if epilogue == "swiglu" else 1)
    shape = (indices.shape[0], out_features) if weights is not None else \
        (indices.shape[0], indices.shape[-1], out_features)
    return x.new_empty(shape, dtype=output_dtype)


def run_expert_blocks(x: Tensor, counts: list[int], linear, weight_at, weight_format: str, bias: Optional[Tensor],
                      output_dtype: torch.dtype, activation_quant: str) -> Tensor:
    """y [S, N] of x [S, K] whose rows are sorted by expert, counts[e] rows for expert e: each expert's block of rows
    by `linear(rows, weight_at(e), weight_format, bias[e], output_dtype, activation_quant)` (`run_linear` on weight
    objects, or the linear op on its arguments), `weight_format` one expert's, bias [E, N] or None."""
    if sum(counts) != x.shape[0]:
        raise ValueError(f"counts must give the rows of each expert, summing to x's {x.shape[0]} rows; got "
                         f"{list(counts)}")
    out = x.new_empty((x.shape[0], WeightFormat.decode(weight_format).shape[0]), dtype=output_dtype)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            out[start:start + count] = linear(x[start:start + count], weight_at(expert), weight_format,
                                              None if bias is None else bias[expert], output_dtype, activation_quant)
        start += count
    return out


@op("expert_blocks")
def expert_blocks(x: Tensor, weight: list[Optional[Tensor]], weight_format: str, counts: Tensor,
                  bias: Optional[Tensor], output_dtype: torch.dtype, activation_quant: str = "none") -> Tensor:
    """y [S, N] of x [S, K] whose rows are sorted by expert, counts[e] rows for expert e (counts: an integer tensor
    [E]): each expert's block times its weight, as `linear` computes it; `weight` the experts' tensors with a leading
    E (expert e's: each one's [e]), `weight_format` one expert's, bias [E, N] or None.  What `bitkern.Experts` runs
    for prompts inside a compiled graph, where the rows per expert are data, not shapes.  Inference only: no
    autograd formula."""
    described = WeightFormat.decode(weight_format)
    if counts.dim() != 1 or counts.dtype.is_floating_point or any(t is not None and t.shape[0] != counts.shape[0]
                                                                   for t in weight):
        raise ValueError(f"counts must be an integer tensor [E] with E the weight tensors' first dimension; got "
                         f"{counts.dtype} {tuple(counts.shape)}")

    return run_expert_blocks(x, counts.tolist(), run_linear,
                             lambda e: weight_of([None if t is None else t[e] for t in weight], described),
                             weight_format, bias, output_dtype, activation_quant)


@expert_blocks.register_fake
def _expert_blocks_fake(x, weight, weight_format, counts, bias, output_dtype, activation_quant="none"):
    return x.new_empty((x.shape[0], WeightFormat.decode(weight_format).shape[0]), dtype=output_dtype)


@op("dequantize")
def dequantize(weight: list[Optional[Tensor]], weight_format: str, dtype: torch.dtype) -> Tensor:
    """The float [N, K] weight, in `dtype`."""
    return _weight(weight, weight_format).to_portable().dequantize(dtype)


@dequantize.register_fake
def _dequantize_fake(weight, weight_format, dtype):
    return weight[0].new_empty(WeightFormat.decode(weight_format).shape, dtype=dtype)


@op("conv2d")
def conv2d(x: Tensor, weight: list[Optional[Tensor]], weight_format: str, bias: Optional[Tensor],
           output_dtype: torch.dtype, kernel_size: list[int], stride: list[int], dilation: list[int],
           padding: list[int]) -> Tensor:
    """y [B, Hout, Wout, Cout] of the channels-last image x [B, H, W, Cin] with the [Cout, kh·kw·Cin] weight
    (taps, then channels); padding is (top, bottom, left, right) zeros."""
    geometry = ConvGeometry(x.shape[-1], x.shape[1], x.shape[2], tuple(kernel_size), tuple(stride), tuple(dilation),
                            tuple(padding))
    spec = spec_of(weight_format, x.dtype, output_dtype, bias is not None, geometry)
    return spec(x, _weight(weight, weight_format), bias)


@conv2d.register_fake
def _conv2d_fake(x, weight, weight_format, bias, output_dtype, kernel_size, stride, dilation, padding):
    height, width = out_size(x.shape[1], x.shape[2], kernel_size, stride, dilation, padding)
    out_features = WeightFormat.decode(weight_format).shape[0]
    return x.new_empty((x.shape[0], height, width, out_features), dtype=output_dtype)


def _save_weight(ctx, x, weight, weight_format, bias) -> None:
    """What both backward formulas need: the weight's tensors and format, and the dtypes of x and bias."""
    ctx.save_for_backward(*weight)
    ctx.weight_format = weight_format
    ctx.x_dtype = x.dtype
    ctx.bias_dtype = None if bias is None else bias.dtype


def _dequantized(ctx) -> Tensor:
    """The float32 weight the saved tensors and format describe."""
    return torch.ops.bitkern.dequantize(list(ctx.saved_tensors), ctx.weight_format, torch.float32)


def _bias_grad(ctx, grad, needed: bool):
    """Σ dy over everything but the output channel (last), or None when the bias needs no gradient."""
    if not needed:
        return None
    return grad.reshape(-1, grad.shape[-1]).float().sum(0).to(ctx.bias_dtype)


def _linear_setup(ctx, inputs, output) -> None:
    x, weight, weight_format, bias = inputs[:4]
    _save_weight(ctx, x, weight, weight_format, bias)


def _linear_backward(ctx, grad):
    """dx = dy · dequant(W) (float32 sums; through an activation quantization as if it were the identity), dbias =
    Σ dy; the weight tensors get none (frozen)."""
    x_needs, _, _, bias_needs = ctx.needs_input_grad[:4]
    grad_x = (grad.float() @ _dequantized(ctx)).to(ctx.x_dtype) if x_needs else None
    return (grad_x, None, None, _bias_grad(ctx, grad, bias_needs), None, None)[:len(ctx.needs_input_grad)]


linear.register_autograd(_linear_backward, setup_context=_linear_setup)


def _linear_epilogue_setup(ctx, inputs, output) -> None:
    x, weight, weight_format, bias, output_dtype, epilogue, residual, norm, norm_weight, norm_bias, eps = inputs[:11]
    _save_weight(ctx, x, weight, weight_format, bias)
    ctx.x, ctx.bias, ctx.epilogue, ctx.output_dtype = x, bias, epilogue, output_dtype
    ctx.norm = (norm, norm_weight, norm_bias, eps)
    ctx.activation_quant = inputs[11] if len(inputs) > 11 else "none"


def _linear_epilogue_backward(ctx, grad):
    """Through f: z = x̂·Wᵀ + b is recomputed by the plain kernel and f differentiated by torch
    (`ops.matmul.epilogue_reference`), then dx̂ = dz · dequant(W), dbias = Σ dz; the residual gets dy; through
    a norm prologue, torch differentiates x̂ (`ops.matmul.norm_reference`) for x and the norm's weight and bias; an
    activation quantization counts as the identity."""
    # the call's arguments, where trailing defaults may have been left out (the gradients match them)
    needs = (*ctx.needs_input_grad, *[False] * (12 - len(ctx.needs_input_grad)))
    x_needs, _, _, bias_needs, _, _, residual_needs, _, norm_weight_needs, norm_bias_needs = needs[:10]
    norm, norm_weight, norm_bias, eps = ctx.norm
    through_norm = x_needs or norm_weight_needs or norm_bias_needs
    grad_z = grad_x = grad_norm_weight = grad_norm_bias = None
    if through_norm or bias_needs:
        weight = list(ctx.saved_tensors)
        with torch.enable_grad():
            x, norm_weight, norm_bias = (None if t is None else t.detach().requires_grad_(True)
                                         for t in (ctx.x, norm_weight, norm_bias))
            x_hat = norm_reference(norm, x, norm_weight, norm_bias, eps)
            z = torch.ops.bitkern.linear(x_hat.detach(), weight, ctx.weight_format, ctx.bias, torch.float32,
                                         ctx.activation_quant)
            z = z.detach().requires_grad_(True)
            (grad_z,) = torch.autograd.grad(epilogue_reference(ctx.epilogue, z), z, grad.float())
            if through_norm:
                grad_x_hat = (grad_z @ _dequantized(ctx)).to(ctx.x_dtype)
                if norm == "none":
                    grad_x = grad_x_hat
                else:
                    wanted = [t for t in (x, norm_weight, norm_bias) if t is not None]
                    grads = torch.autograd.grad(x_hat, wanted, grad_x_hat)
                    grad_x, grad_norm_weight = grads[:2]
                    grad_norm_bias = grads[2] if norm_bias is not None else None
    grad_residual = grad.to(ctx.output_dtype) if residual_needs else None
    grads = (grad_x if x_needs else None, None, None, _bias_grad(ctx, grad_z, bias_needs), None, None, grad_residual,
             None, grad_norm_weight if norm_weight_needs else None, grad_norm_bias if norm_bias_needs else None, None,
             None)
    return grads[:len(ctx.needs_input_grad)]


linear_epilogue.register_autograd(_linear_epilogue_backward, setup_context=_linear_epilogue_setup)


def _conv2d_setup(ctx, inputs, output) -> None:
    x, weight, weight_format, bias, _, kernel_size, stride, dilation, padding = inputs
    _save_weight(ctx, x, weight, weight_format, bias)
    ctx.geometry = (x.shape, kernel_size, stride, dilation, padding)


def _conv2d_backward(ctx, grad):
    """dx = the transposed convolution of dy with dequant(W) (float32), dbias = Σ dy; the weight gets none."""
    x_needs, _, _, bias_needs, *_ = ctx.needs_input_grad
    grad_x = None
    if x_needs:
        (batch, height, width, channels), kernel_size, stride, dilation, (top, bottom, left, right) = ctx.geometry
        weight = conv_weight(_dequantized(ctx), kernel_size, channels)
        padded = (batch, channels, height + top + bottom, width + left + right)
        grad_padded = torch.nn.grad.conv2d_input(padded, weight, grad.float().permute(0, 3, 1, 2), stride, 0,
                                                 dilation)
        grad_x = grad_padded[:, :, top:top + height, left:left + width].permute(0, 2, 3, 1).to(ctx.x_dtype)
    return grad_x, None, None, _bias_grad(ctx, grad, bias_needs), None, None, None, None, None


conv2d.register_autograd(_conv2d_backward, setup_context=_conv2d_setup)
