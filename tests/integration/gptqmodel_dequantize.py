"""Run with gptqmodel's Python: load a GPTQ checkpoint directory with gptqmodel (torch kernel, CPU) and save
every quantized module's dequantized weight ([out, in], gptqmodel's own computation) to a safetensors file.

usage: python gptqmodel_dequantize.py CHECKPOINT_DIRECTORY OUTPUT_FILE
"""

import os
import sys

import torch

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")


def main(checkpoint: str, output: str) -> None:
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocabulary = {f"t{i}": i for i in range(8)}  # gptqmodel loads a tokenizer with every model
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocabulary, unk_token="t0")),
                            unk_token="t0", pad_token="t1").save_pretrained(checkpoint)
    model = GPTQModel.load(checkpoint, backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
    weights = {name: module.dequantize_weight().T.contiguous()
               for name, module in model.model.named_modules() if isinstance(module, BaseQuantLinear)}
    save_file(weights, output)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
