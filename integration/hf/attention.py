"""Attention of one new token over the KV cache, for decoding on the CPU: what `generate` runs per layer and step.

torch's scaled_dot_product_attention serves a decode step of a grouped-query model through its general kernel
(work split over heads, buffers sized for long query blocks); for one query row a few batched products over the
key/value heads do the same work with less fixed cost per call.  Registered with transformers' public
`AttentionInterface` (and the "sdpa" boolean mask through `AttentionMaskInterface`) as "bitkern_decode";
`use_decode_attention(model)` selects it.  Anything but one query row (the prompt), training with dropout, and
the features this does not implement (soft-capping, attention sinks, position biases) go to transformers' "sdpa".
"""

from __future__ import annotations

import torch

NAME = "bitkern_decode"
# attention features of some transformers models this function does not implement: such calls go to "sdpa"
UNSUPPORTED = ("softcap", "s_aux", "position_bias", "sinks")


def decode_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """softmax(q·kᵀ·scaling + mask)·v for query [batch, heads, 1, dim] over key/value [batch, kv_heads, length,
    dim] (heads a multiple of kv_heads), in float32 as SDPA accumulates; returns [batch, 1, heads, dim] in the
    query's dtype, as transformers' attention functions do."""
    batch, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    if (rows != 1 or (dropout and module.training) or heads % kv_heads or kwargs.get("output_attentions")
            or any(kwargs.get(name) is not None for name in UNSUPPORTED)):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = dim ** -0.5 if scaling is None else scaling
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim).float() * scale  # the heads of each kv head
    scores = torch.matmul(grouped, key.float().transpose(-1, -2))  # [batch, kv_heads, group, length]
    if attention_mask is not None:  # [batch, 1, 1, length]: boolean (True: attend) or additive
        scores = (scores.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool
                  else scores + attention_mask)
    output = torch.matmul(scores.softmax(-1), value.float())  # [batch, kv_heads, group, dim]
    return output.to(query.dtype).reshape(batch, 1, heads, dim), None


def register() -> None:
    """Make "bitkern_decode" an attention implementation transformers knows (with the "sdpa" mask); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_decode_attention(model) -> None:
    """Run `model`'s attention (a transformers model) through `decode_attention` from now on."""
    register()
    model.set_attn_implementation(NAME)
