"""Make the bitsandbytes 4-bit fixtures with transformers + bitsandbytes on the CPU, and store bitsandbytes'
own dequantization (`bitsandbytes.functional.dequantize_4bit`) with each.

Run in a virtual environment with the tool:
    python -m venv /work/venvs/importers-bnb
    /work/venvs/importers-bnb/bin/pip install torch==2.13.0 bitsandbytes==0.50.2 transformers==5.23.0 accelerate
    /work/venvs/importers-bnb/bin/python tools/format_fixtures/make_bnb.py
Writes tests/fixtures/formats/bnb_*/ (config.json, model.safetensors, reference.safetensors) and
tests/fixtures/formats/bnb_4bit_tables.safetensors (the value of every 4-bit code, from bitsandbytes' kernel).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny_llama  # noqa: E402

# name -> BitsAndBytesConfig arguments: nf4 and fp4, with and without double quantization, block sizes.
FIXTURES = {
    "bnb_nf4": dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=False),
    "bnb_nf4_double_quant": dict(bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "bnb_fp4_double_quant": dict(bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True),
}
DTYPE = {"bnb_fp4_double_quant": torch.bfloat16}  # the model's dtype (float16 otherwise)


def make(name: str, base: str, work: str) -> None:
    import bitsandbytes
    from bitsandbytes.functional import dequantize_4bit
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    dtype = DTYPE.get(name, torch.float16)
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype, **FIXTURES[name])
    model = LlamaForCausalLM.from_pretrained(base, quantization_config=config, dtype=dtype, device_map="cpu")
    output = os.path.join(work, name)
    model.save_pretrained(output)
    fixture = tiny_llama.keep(output, name)
    reference = {module_name: dequantize_4bit(module.weight.data, module.weight.quant_state)
                 for module_name, module in model.named_modules() if isinstance(module, bitsandbytes.nn.Linear4bit)}
    tiny_llama.save_reference(fixture, reference, f"bitsandbytes {bitsandbytes.__version__} dequantize_4bit")
    print(name, "->", fixture, len(reference), "modules")


def save_code_tables() -> None:
    """Every code's value as bitsandbytes' CPU kernel decodes it (absmax 1, float32), nf4 and fp4."""
    import bitsandbytes  # noqa: F401  (registers its ops)
    from safetensors.torch import save_file

    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] << 4 | codes[1::2]).reshape(1, 8)  # first element in the high nibble
    tables = {quant_type: torch.ops.bitsandbytes.dequantize_4bit.default(packed, torch.ones(1), 64, quant_type,
                                                                        (1, 16), torch.float32).reshape(16)
              for quant_type in ("nf4", "fp4")}
    save_file(tables, os.path.join(tiny_llama.OUTPUT_DIRECTORY, "bnb_4bit_tables.safetensors"))


def main(names):
    save_code_tables()
    tiny_llama.make_all(make, names, FIXTURES)


if __name__ == "__main__":
    main(sys.argv[1:])
