"""A tiny random gpt-oss model written as the released openai/gpt-oss MXFP4 checkpoints are laid out, for the import
tests (test_formats_mxfp4.py) and the vLLM engine (test_vllm_moe.py): config.json with
quantization_config {"quant_method": "mxfp4", "modules_to_not_convert": [...]} (the released list), bf16 tensors,
uint8 blocks [E, N, K/32, 16] and scales [E, N, K/32] for the experts, float biases, safetensors shards with an index.
Transformers cannot write such a checkpoint here: its Mxfp4 quantizer quantizes and serializes only through the
`kernels` hub package's triton kernels (`triton_kernels_hub.numerics_details.mxfp.downcast_to_mxfp_torch`, the
swizzled triton tensors), which need a download and triton; with `dequantize=True` it keeps float experts and saves
them float.  So `encode_mxfp4`, written from the OCP MX v1.0 spec (not from bitkern's or transformers' code),
makes the blocks and scales, and transformers' own reader (`convert_moe_packed_tensors`, and `from_pretrained` with
`Mxfp4Config(dequantize=True)`) is the reference every import is checked against."""

import json
import os

import torch
from safetensors.torch import save_file

LAYERS = 2
EXPERTS = "model.layers.{}.mlp.experts"
# the released gpt-oss-20b / -120b checkpoints' list
RELEASED_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def encode_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4 of a float [E, N, K] weight as gpt-oss stores it: (blocks uint8 [E, N, K/32, 16], scales uint8
    [E, N, K/32]).  Per block of 32 along K: shared exponent X = floor(log2(max|w|)) − 2 (e2m1's largest exponent),
    stored as X + 127; each element the e2m1 code of the nearest magnitude of w / 2^X (clamped to 6) and its sign;
    element 2j in the low nibble of byte j."""
    experts, n, k = weight.shape
    blocks = weight.float().reshape(experts, n, k // 32, 32)
    amax = blocks.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent).unsqueeze(-1)
    magnitude = (scaled.abs().unsqueeze(-1) - E2M1_MAGNITUDES).abs().argmin(-1)
    codes = (magnitude | (torch.signbit(scaled).long() << 3)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8)


def gpt_oss_config(**attention):
    import transformers

    geometry = dict(dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16), **attention)
    return transformers.GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS, vocab_size=128,
                                     **geometry,
                                     num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                                     sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                     initializer_range=0.2)  # logits far from uniform: distinct greedy tokens


def gpt_oss_checkpoint(not_converted=(), **attention) -> tuple[dict, dict]:
    """(config.json as a dict, tensors) of the tiny gpt-oss model in the released layout; the experts modules named
    in `not_converted` stay float (bf16, the model's [E, K, N] layout) and are listed in modules_to_not_convert;
    `attention` overrides the attention geometry (4 heads of 16, 2 key/value heads)."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(gpt_oss_config(**attention))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.1)
    config = model.config.to_dict()
    config["dtype"], config["architectures"] = "bfloat16", ["GptOssForCausalLM"]
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": RELEASED_NOT_CONVERTED + list(not_converted)}
    tensors = {}
    for key, value in model.state_dict().items():
        module, _, name = key.rpartition(".")
        if name in ("gate_up_proj", "down_proj") and module not in not_converted:
            blocks, scales = encode_mxfp4(value.transpose(1, 2))  # the model's [E, K, N] as [E, N, K]
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
        else:
            tensors[key] = value.to(torch.bfloat16).contiguous()
    return config, tensors


def write_checkpoint(folder, config: dict, tensors: dict) -> str:
    """The checkpoint as safetensors shards (layer 0's tensors, then the rest) with their index, as released."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as file:
        json.dump(config, file, indent=2)
    shards = {"model-00000-of-00001.safetensors": {}, "model-00001-of-00001.safetensors": {}}
    for key, value in tensors.items():
        shards["model-00000-of-00001.safetensors" if key.startswith("model.layers.0.")
               else "model-00001-of-00001.safetensors"][key] = value
    weight_map = {}
    for shard, part in shards.items():
        save_file(part, os.path.join(folder, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(value.numel() * value.element_size() for value in tensors.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as file:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, file, indent=2)
    return str(folder)


