"""Make the GPTQ fixtures with gptqmodel itself, and store gptqmodel's own dequantization with each.

Run in a virtual environment with the tool (CPU quantization; nothing is downloaded):
    python -m venv /work/venvs/importers-gptq
    /work/venvs/importers-gptq/bin/pip install torch==2.13.0 gptqmodel==7.6.0
    GPTQMODEL_CPU_WORKERS=2 /work/venvs/importers-gptq/bin/python tools/format_fixtures/make_gptq.py [NAME ...]
Writes tests/fixtures/formats/gptq_*/ (config.json, model.safetensors, quantize_config.json,
reference.safetensors).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

import tiny_llama  # noqa: E402

# name -> QuantizeConfig arguments: every bit width, sym and asym, act-order, both checkpoint formats.
FIXTURES = {
    "gptq_4bit_sym": dict(bits=4, group_size=32, sym=True, desc_act=False),
    "gptq_4bit_asym_actorder": dict(bits=4, group_size=32, sym=False, desc_act=True),
    "gptq_4bit_asym_v2": dict(bits=4, group_size=32, sym=False, desc_act=False, format="gptq_v2"),
    "gptq_3bit_asym_actorder": dict(bits=3, group_size=32, sym=False, desc_act=True),
    "gptq_2bit_sym": dict(bits=2, group_size=32, sym=True, desc_act=False),
    "gptq_8bit_asym_channel": dict(bits=8, group_size=-1, sym=False, desc_act=False, act_group_aware=False),
}


def make(name: str, base: str, work: str) -> None:
    quantize(name, base, work, FIXTURES[name])


def quantize(name: str, base: str, work: str, settings: dict, directory: str = tiny_llama.OUTPUT_DIRECTORY) -> None:
    """Quantize the model saved at `base` with gptqmodel (QuantizeConfig(**settings)) and keep it as the fixture `name`
    under `directory`, with gptqmodel's own dequantization of every quantized layer."""
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    model = GPTQModel.load(base, QuantizeConfig(**settings), device="cpu", dtype=torch.float16)
    model.quantize(tiny_llama.calibration(), batch_size=1)
    output = os.path.join(work, name)
    model.save(output)
    fixture = tiny_llama.keep(output, name, directory)
    loaded = GPTQModel.load(output, backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)  # (with its tokenizer)
    reference = {module_name: module.dequantize_weight().T
                 for module_name, module in loaded.model.named_modules() if isinstance(module, BaseQuantLinear)}
    tiny_llama.save_reference(fixture, reference, "gptqmodel 7.6.0 TorchLinear.dequantize_weight")
    print(name, "->", fixture, len(reference), "modules")


def main(names):
    tiny_llama.make_all(make, names, FIXTURES)


if __name__ == "__main__":
    main(sys.argv[1:])
