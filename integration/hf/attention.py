"""Grouped-query attention for decoding, as transformers' attention implementation "bitkern" (`AttentionInterface`
and `AttentionMaskInterface`, no patching): one query row attends over each KV head with that head's group of query
heads packed as rows, so the KV cache is read once per KV head, eager or under torch.compile.  On a CPU a decode
step runs bitkern's decode-attention kernel (`bitkern.nn.attention`; a custom op under torch.compile): ~10-15 µs
per layer where SDPA takes ~30-100 µs at that size; where the kernel does not apply (autograd, a head dimension
not a multiple of 16, a mask per query head, a GPU), SDPA on the packed groups.

Transformers' "sdpa" packs the groups in eager only; traced by torch.compile it repeats K and V for every query
head and SDPA runs one row per head (the Llama of benchmarks/llama_cpp.py, 2 threads, after a 496-token prompt:
25.8 ms per compiled decode step with "sdpa", 17.5 ms with "bitkern",
benchmarks/results/llama_decode_profile_long_context.md).  Prompts, models without groups and options the packing
does not cover go to transformers' "sdpa" unchanged; masks are sdpa's.

Entry point: `use_grouped_attention(model)` (registers "bitkern", then `model.set_attn_implementation`);
`register()` alone makes `from_pretrained(..., attn_implementation="bitkern")` work.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ...cache import KernelNotFound
from ...cache.attention import CAN_BUILD
from ...nn.attention import KERNEL_DTYPES, decode_attention
from ...ops.attention import LANES, DecodeAttention
from ...ttype import dtype_name

log = logging.getLogger("bitkern")
NAME = "bitkern"
# attention options the packed path does not implement: a call with any of them set goes to "sdpa"
SDPA_ONLY_OPTIONS = ("softcap", "position_bias", "cache", "s_aux", "sinks")


def grouped_query_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [B, H, 1, D], key/value [B, Hkv, L, D] -> ([B, 1, H, D],
    None); any other call is transformers' "sdpa"."""
    batch, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    if rows != 1 or kv_heads == heads or dropout != 0.0 or any(kwargs.get(name) is not None
                                                               for name in SDPA_ONLY_OPTIONS):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = heads // kv_heads
    mask = attention_mask
    if _kernel_applies(query, key, value, mask):
        attend = torch.ops.bitkern.decode_attention if torch.compiler.is_compiling() else decode_attention
        try:
            output = attend(query.reshape(batch * kv_heads, groups, dim),
                            key.reshape(batch * kv_heads, key.shape[2], dim),
                            value.reshape(batch * kv_heads, key.shape[2], dim),
                            None if mask is None else mask.reshape(mask.shape[0], mask.shape[-1]),
                            dim ** -0.5 if scaling is None else scaling)
            return output.reshape(batch, 1, heads, dim), None
        except KernelNotFound as error:
            _warn_no_kernel(str(error))
    if mask is not None and mask.shape[1] == heads:  # a mask per query head goes with its row
        mask = mask.reshape(mask.shape[0], kv_heads, groups, mask.shape[-1])
    output = scaled_dot_product_attention(query.reshape(batch, kv_heads, groups, dim), key, value, attn_mask=mask,
                                          scale=scaling)
    return output.reshape(batch, 1, heads, dim), None


def _kernel_applies(query, key, value, mask) -> bool:
    """Whether bitkern's decode-attention kernel takes this decode step: CPU, no autograd, one dtype it has, head
    dimension a multiple of 16, a mask shared by the heads (or none) over the whole cache; under torch.compile
    only where this process can build the kernel (a missing kernel cannot fall back inside a compiled graph)."""
    if query.device.type != "cpu" or query.dtype not in KERNEL_DTYPES:
        return False
    if torch.compiler.is_compiling() and not CAN_BUILD:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return False
    if key.dtype != query.dtype or value.dtype != query.dtype or query.shape[-1] % LANES \
            or value.shape != key.shape:
        return False
    return mask is None or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1
                            and mask.shape[-1] == key.shape[2] and mask.shape[0] in (1, query.shape[0])
                            and (mask.dtype == torch.bool or mask.is_floating_point()))


@functools.lru_cache(maxsize=1)
def _warn_no_kernel(reason: str) -> None:
    log.warning("bitkern: decode attention runs on SDPA: %s", reason)


def decode_attention_specs(model, dtype: torch.dtype) -> list[DecodeAttention]:
    """The decode-attention kernels a transformers model running "bitkern" attention on a CPU calls with inputs of
    `dtype` (what `bitkern.prepare` builds ahead): per distinct (query heads per KV head, head dimension) of its
    attention modules that the kernel takes (see `_kernel_applies`), one per mask a decode step passes (none, and
    bool for a padded batch)."""
    if dtype not in KERNEL_DTYPES or any(p.device.type != "cpu" for p in model.parameters()):
        return []
    shapes = {(module.num_key_value_groups, module.head_dim) for module in model.modules()
              if isinstance(getattr(module, "num_key_value_groups", None), int)
              and isinstance(getattr(module, "head_dim", None), int)}
    return [DecodeAttention(dtype_name(dtype), groups, dim, mask) for groups, dim in sorted(shapes)
            if groups > 1 and dim % LANES == 0 for mask in ("none", "bool")]


def register() -> None:
    """Make "bitkern" an attention implementation of transformers (its masks: sdpa's)."""
    AttentionInterface.register(NAME, grouped_query_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_grouped_attention(model):
    """Switch a transformers model's attention to "bitkern" (registering it first); returns the model."""
    if not callable(getattr(model, "set_attn_implementation", None)):
        raise TypeError(f"model must be a transformers PreTrainedModel (it sets its attention implementation), got "
                        f"{type(model).__name__}")
    register()
    model.set_attn_implementation(NAME)
    return model
