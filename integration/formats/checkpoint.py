"""Reading a checkpoint directory as Hugging Face writes it: config.json (with its quantization_config, or
GPTQ's quantize_config.json beside it) and safetensors weights (one file or an index of shards)."""

from __future__ import annotations

import json
import os

import safetensors
import safetensors.torch

from .imported import FormatError

QUANTIZE_CONFIG_FILES = ("quantize_config.json", "quant_config.json")
WEIGHTS = "model.safetensors"


def read_config(path: str) -> dict:
    """The directory's config.json as a dict, its quantization_config filled from a tool's own file if absent."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FormatError(f"{path} has no config.json; a checkpoint directory needs one")
    with open(config_file) as file:
        config = json.load(file)
    if "quantization_config" not in config:
        for name in QUANTIZE_CONFIG_FILES:
            if os.path.isfile(os.path.join(path, name)):
                with open(os.path.join(path, name)) as file:
                    config["quantization_config"] = {"quant_method": "gptq", **json.load(file)}
                break
    return config


def weight_files(path: str) -> list[str]:
    """The safetensors files holding the directory's weights."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as file:
            shards = sorted(set(json.load(file)["weight_map"].values()))
        files = [os.path.join(path, shard) for shard in shards]
    else:
        files = [os.path.join(path, WEIGHTS)]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FormatError(f"{path} lacks the weights {missing} (safetensors: {WEIGHTS}, or shards listed in "
                          f"model.safetensors.index.json); only safetensors checkpoints are read")
    return files


def read_tensors(path: str) -> dict:
    """Every tensor of the directory's safetensors files (on the CPU)."""
    tensors = {}
    for file in weight_files(path):
        tensors.update(safetensors.torch.load_file(file))
    return tensors


def bitkern_metadata(path: str) -> bool:
    """Whether the directory's weights were written by `bitkern.save` (their metadata says how to load them)."""
    with safetensors.safe_open(weight_files(path)[0], "pt") as file:
        return "bitkern" in (file.metadata() or {})
