"""Run with gptqmodel's Python: quantize linear layers with gptqmodel's own GPTQ (its `GPTQ` class, as
transformers' optimum path drives it) and save the dequantized weights it computes.

usage: python gptqmodel_quantize.py INPUT_FILE OUTPUT_FILE [INPUT_FILE OUTPUT_FILE ...]
each INPUT_FILE (safetensors): "weight" [N, K] float32, "calibration" [rows, K] float32, and "settings" (a uint8
tensor holding JSON: bits, group_size, sym, desc_act, damp).  OUTPUT_FILE: "weight", gptqmodel's dequantized
weight [N, K] float32.
"""

import json
import os
import sys

import torch

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")


def main(source: str, output: str) -> None:
    from gptqmodel.quantization.config import QuantizeConfig
    from gptqmodel.quantization.gptq import GPTQ
    from safetensors.torch import load_file, save_file

    tensors = load_file(source)
    settings = json.loads(bytes(tensors["settings"].tolist()).decode())
    weight = tensors["weight"]
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    layer.weight.data = weight.clone()
    config = QuantizeConfig(bits=settings["bits"], group_size=settings["group_size"], sym=settings["sym"],
                            desc_act=settings["desc_act"], act_group_aware=False, damp_percent=settings["damp"])
    quantizer = GPTQ(layer, config)
    quantizer.quantizer.configure(perchannel=True)
    for batch in tensors["calibration"].split(512):
        quantizer.add_batch(batch, None)
    quantizer.hf_quantize(percdamp=settings["damp"], group_size=settings["group_size"], actorder=settings["desc_act"],
                          act_group_aware=False)
    save_file({"weight": layer.weight.data.float().contiguous()}, output)


if __name__ == "__main__":
    for source, output in zip(sys.argv[1::2], sys.argv[2::2]):
        main(source, output)
