"""Make the mixture-of-experts GPTQ fixtures with gptqmodel itself (tiny random Qwen3-MoE and Mixtral models), and
store gptqmodel's own dequantization of each checkpoint with it.

gptqmodel splits each transformers 5 experts module (3-D gate_up_proj / down_proj) into one linear layer per expert
and projection, quantizes those, and writes them as `model.layers.L.mlp.experts.E.{gate,up,down}_proj.{qweight,
qzeros,scales,g_idx}` (for Mixtral too: its modules are named as transformers 5 names them).

Run in the virtual environment with the tool (CPU quantization; nothing is downloaded), as make_gptq.py:
    GPTQMODEL_CPU_WORKERS=2 /path/to/venv/bin/python tools/format_fixtures/make_gptq_moe.py [NAME ...]
Writes tests/fixtures/formats_moe/<NAME>/ (config.json, model.safetensors, quantize_config.json,
reference.safetensors: the dequantized [out, in] weight of every quantized linear layer, per expert).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import make_gptq  # noqa: E402
import tiny_llama  # noqa: E402

OUTPUT_DIRECTORY = os.path.join(os.path.dirname(tiny_llama.OUTPUT_DIRECTORY), "formats_moe")
# name -> (architecture, QuantizeConfig arguments)
FIXTURES = {
    "gptq_qwen3_moe_4bit_sym": ("qwen3_moe", dict(bits=4, group_size=32, sym=True, desc_act=False)),
    "gptq_mixtral_4bit_asym": ("mixtral", dict(bits=4, group_size=32, sym=False, desc_act=False)),
    "gptq_qwen3_moe_4bit_actorder": ("qwen3_moe", dict(bits=4, group_size=32, sym=False, desc_act=True)),
}


def build(architecture: str, path: str, dtype=torch.float16, seed: int = 0) -> None:
    """Save a 2-layer model with 4 experts of top-2 and the fixtures' tokenizer to `path`: hidden 64 and experts of 64,
    the shapes of the dense fixtures' tiny Llama, so that the tests share its kernels."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=tiny_llama.VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=128, tie_word_embeddings=False)
    if architecture == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                                                   head_dim=16, **common))
    else:
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=64, num_local_experts=4, **common))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0, 0.08)
    model.to(dtype).save_pretrained(path)
    tiny_llama.save_tokenizer(path)


def make(name: str, work: str) -> None:
    architecture, settings = FIXTURES[name]
    base = os.path.join(work, "base")
    build(architecture, base)
    make_gptq.quantize(name, base, work, settings, OUTPUT_DIRECTORY)


def main(names):
    """Make one fixture here, or each of several in a process of its own: gptqmodel 7.6.0 patches transformers'
    MoE blocks per architecture, and a Mixtral quantized after a Qwen3-MoE in one process fails to load
    ("LazyTurtle: ... checkpoint tensor could not be reshaped into the target layout")."""
    import subprocess
    import tempfile

    names = names or list(FIXTURES)
    if len(names) > 1:
        for name in names:
            subprocess.run([sys.executable, os.path.abspath(__file__), name], check=True)
        return
    with tempfile.TemporaryDirectory() as work:
        make(names[0], work)


if __name__ == "__main__":
    main(sys.argv[1:])
