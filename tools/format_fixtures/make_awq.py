"""Make the AWQ ("gemm" version) fixture with AutoAWQ's own quantization rule and packing code, and store
AutoAWQ's own dequantization (`awq.utils.packing_utils.dequantize_gemm`) with it.

AWQ's activation-aware scale search needs CUDA; the format is made by its zero-point quantizer
(`AwqQuantizer.pseudo_quantize_tensor`) and packer (`WQLinear_GEMM.from_linear`), plain tensor code that
runs on the CPU, applied as AutoAWQ's `_apply_quant` applies them.  Run in a virtual environment with it:
    /work/venvs/importers-bnb/bin/pip install --no-deps autoawq==0.2.9 && \
        /work/venvs/importers-bnb/bin/pip install accelerate datasets zstandard
    /work/venvs/importers-bnb/bin/python tools/format_fixtures/make_awq.py
Writes tests/fixtures/formats/awq_4bit_gemm/ (config.json, model.safetensors, reference.safetensors).
"""

import json
import os
import sys
import tempfile
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny_llama  # noqa: E402

GROUP_SIZE = 32
QUANTIZATION_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": GROUP_SIZE, "zero_point": True,
                       "version": "gemm", "modules_to_not_convert": None}


def main():
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.quantize.quantizer import AwqQuantizer
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import save_file

    quantizer = types.SimpleNamespace(w_bit=4, group_size=GROUP_SIZE, zero_point=True)
    with tempfile.TemporaryDirectory() as work:
        model = tiny_llama.build(os.path.join(work, "base")).to(torch.float16)
        state, reference = {}, {}
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear) or name == "lm_head":
                continue
            weight, scales, zeros = AwqQuantizer.pseudo_quantize_tensor(quantizer, module.weight.data)
            module.weight.data = weight
            packed = WQLinear_GEMM.from_linear(module, 4, GROUP_SIZE, False, scales.t().contiguous(),
                                               zeros.t().contiguous())
            for tensor in ("qweight", "qzeros", "scales"):
                state[f"{name}.{tensor}"] = getattr(packed, tensor).contiguous()
            reference[name] = dequantize_gemm(packed.qweight, packed.qzeros, packed.scales, 4, GROUP_SIZE).T
        quantized = set(reference)
        for key, tensor in model.state_dict().items():
            if key.rpartition(".")[0] not in quantized:
                state[key] = tensor.contiguous()
        output = os.path.join(work, "awq")
        os.makedirs(output)
        save_file(state, os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config["quantization_config"] = QUANTIZATION_CONFIG
        with open(os.path.join(output, "config.json"), "w") as file:
            json.dump(config, file, indent=2)
        fixture = tiny_llama.keep(output, "awq_4bit_gemm")
    tiny_llama.save_reference(fixture, reference, "autoawq 0.2.9 dequantize_gemm")
    print("awq_4bit_gemm ->", fixture, len(reference), "modules")


if __name__ == "__main__":
    main()
