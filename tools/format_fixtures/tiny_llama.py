"""The tiny random Llama every format fixture is made from (made locally, nothing downloaded).

Shared by the fixture scripts beside this file, each run in the virtual environment of its tool.
"""

import os

import torch

VOCAB = 128
OUTPUT_DIRECTORY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fixtures", "formats")
# Files of a tool's output directory that a fixture keeps (tokenizers and logs are not needed to load it).
KEPT_FILES = ("config.json", "model.safetensors", "quantize_config.json")


def build(path: str, dtype=torch.float16, seed: int = 0):
    """Save a 2-layer Llama (hidden 64, MLP 128, 4 heads, 2 KV heads) with a word-level tokenizer to `path`.

    The first 8 output rows of layer 0's q_proj are made non-negative, so that asymmetric quantizers meet
    groups whose zero point is 0 (the case GPTQ's v1 format stores as -1)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0, 0.08)
        q_proj = model.model.layers[0].self_attn.q_proj.weight
        q_proj[:8] = q_proj[:8].abs() + 0.02
    model.to(dtype).save_pretrained(path)
    save_tokenizer(path)
    return model


def save_tokenizer(path: str) -> None:
    """Save the word-level tokenizer of the VOCAB tokens t0..t127 to `path` (the tools load one with every model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t1", eos_token="t2",
                            bos_token="t3").save_pretrained(path)


def make_all(make, names, fixtures) -> None:
    """Call make(name, base directory, work directory) for each of `names` (all `fixtures` if none) on one
    freshly built base model."""
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        base = os.path.join(work, "base")
        build(base)
        for name in names or fixtures:
            make(name, base, work)


def calibration(samples: int = 8, length: int = 32, seed: int = 1) -> list[dict]:
    """Random token sequences for calibrating quantizers."""
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (1, length), generator=generator),
             "attention_mask": torch.ones(1, length, dtype=torch.long)} for _ in range(samples)]


def keep(source: str, name: str, directory: str = OUTPUT_DIRECTORY) -> str:
    """Copy the kept files of a tool's output directory into the fixture `name` under `directory`; returns the
    fixture's directory."""
    import shutil

    target = os.path.join(directory, name)
    shutil.rmtree(target, ignore_errors=True)
    os.makedirs(target)
    for file in KEPT_FILES:
        if os.path.exists(os.path.join(source, file)):
            shutil.copy(os.path.join(source, file), target)
    return target


def save_reference(directory: str, weights: dict, tool: str) -> None:
    """Store the producing tool's own dequantized weights ([out, in] per quantized module) with a fixture."""
    from safetensors.torch import save_file

    save_file({f"{name}.weight": w.contiguous() for name, w in weights.items()},
              os.path.join(directory, "reference.safetensors"), metadata={"tool": tool})
