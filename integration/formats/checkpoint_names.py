"""A model type's older checkpoint tensor names as transformers 5 loads them, read from transformers' own conversion
mapping for that type (`transformers.conversion_mapping`), not a copy of it: its renamings of module paths (Mixtral's
".block_sparse_moe." -> ".mlp."), and the per-expert linear layers its converters merge into each experts parameter
(Mixtral's w1 and w3 into gate_up_proj, gate then up, and w2 into down_proj), as bitkern's expert layers name them
(gate_proj, up_proj, down_proj).  So a transformers-4-era Mixtral GPTQ checkpoint (AutoGPTQ,
`model.layers.N.block_sparse_moe.experts.E.w1.qweight`) imports as GPTQModel's transformers 5 ones do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from bitkern.nn.experts import FLOAT_PARAMETERS

# bitkern's projection -> the expert linear layers it stacks by rows, in order
STACKED = {"gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
_MERGED_LAYER = re.compile(r".*experts\.\*\.(?P<layer>\w+)\.weight")


@dataclass(frozen=True)
class CheckpointNames:
    """renamings: transformers' WeightRenaming entries for the model type; expert_layers: {the checkpoint's name of an
    expert's linear layer: bitkern's} where they differ."""

    renamings: tuple = ()
    expert_layers: dict = field(default_factory=dict)

    def rename(self, key: str) -> str:
        """A module or tensor name of the checkpoint as the transformers 5 model names it."""
        if not self.renamings:
            return key
        from transformers.core_model_loading import rename_source_key

        return rename_source_key(key, list(self.renamings), [])[0]

    def expert_layer(self, stored: str) -> str:
        """bitkern's name (gate_proj, up_proj, down_proj) of an expert's linear layer the checkpoint calls `stored`."""
        return self.expert_layers.get(stored, stored)


def checkpoint_names(model_type: str | None) -> CheckpointNames:
    """The older names transformers 5 renames as it loads checkpoints of `model_type` (config.json's "model_type";
    None, an unknown type, or a transformers without conversion mappings: none)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return CheckpointNames()
    mapping = (get_checkpoint_conversion_mapping(model_type) if model_type else None) or []
    expert_layers = {}
    for entry in mapping:
        if not isinstance(entry, WeightConverter) or len(entry.target_patterns) != 1:
            continue
        for projection, layers in STACKED.items():
            if not entry.target_patterns[0].endswith(f"experts.{FLOAT_PARAMETERS[projection]}"):
                continue
            merged = [_MERGED_LAYER.fullmatch(source) for source in entry.source_patterns]
            if len(merged) == len(layers) and all(merged):
                expert_layers.update({match["layer"]: layer for match, layer in zip(merged, layers)
                                      if match["layer"] != layer})
    return CheckpointNames(tuple(entry for entry in mapping if isinstance(entry, WeightRenaming)), expert_layers)
