"""What `--quantization bitkern` quantizes to: the weight settings of bitkern.Linear, read from a JSON object.

Users pass them through vLLM's channel for a quantization config that is not in the checkpoint:
`hf_overrides={"quantization_config_dict_json": '{"dtype": "int4", "group_size": 128}'}`.
Every value is checked here, in the process that builds the engine, so bad settings fail at engine start.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from bitkern import ttype
from bitkern.nn.library import FLOAT_DTYPES
from bitkern.nn.storage import check_float_dtype, check_weight_dtype, dtype_name
from bitkern.ttype.quantize import SCALE_DTYPES, check_group_size, check_method, check_zero_mode, default_zero_mode


@dataclass(frozen=True)
class Settings:
    """bitkern.Linear's weight settings (same names and defaults), plus the layers to leave in float.

    modules_to_not_convert: vLLM module names, or their last components ("down_proj", "layers.0.mlp.down_proj");
    the names of the projections vLLM merges (q_proj, k_proj, v_proj, gate_proj, up_proj) work too, and so do
    mixture-of-experts layers ("experts", "layers.0.mlp.experts"), which then keep all their experts float.
    """

    dtype: str = "nf4"
    group_size: int | None = None
    zero_mode: str | None = None
    scale_dtype: torch.dtype = torch.float16
    compute_dtype: torch.dtype | None = None
    method: str = "rtn"
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, value) -> "Settings":
        """Settings from a JSON object (as text, or already parsed); ValueError naming any bad key or value."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"quantization_config_dict_json is not valid JSON ({error}): {value!r}") from None
        if not isinstance(value, dict):
            raise TypeError(f"bitkern settings must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown bitkern settings {unknown}; accepted: {list(cls.__dataclass_fields__)}")
        fields = dict(value)
        for name, accepted, allow_none in (("scale_dtype", SCALE_DTYPES, False),
                                           ("compute_dtype", FLOAT_DTYPES, True)):
            if name in fields:
                fields[name] = check_float_dtype(name, fields[name], accepted, allow_none)
        skip = fields.get("modules_to_not_convert") or ()
        if isinstance(skip, str) or not all(isinstance(name, str) for name in skip):
            raise TypeError(f"modules_to_not_convert must be a list of module names, got {skip!r}")
        fields["modules_to_not_convert"] = tuple(skip)
        return cls(**fields)

    def __post_init__(self):
        weight_type = ttype.get(check_weight_dtype(self.dtype))
        if weight_type.tensor_scale:
            raise ValueError(f"dtype={self.dtype!r} keeps one scale per tensor, which vLLM's merged (q/k/v, "
                             f"gate/up) and tensor-parallel layers would each compute differently; use a type "
                             f"with group scales only (e.g. mxfp4, nf4, int4)")
        group_size = self.group_size
        if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)
                                       or (group_size < 1 and group_size != -1)):
            raise ValueError(f"group_size={group_size!r} must be a positive int, -1 (per output channel) or null "
                             f"(the default: 128, or the type's block)")
        if weight_type.block_size > 1:
            check_group_size(weight_type, group_size, weight_type.block_size)
        check_zero_mode(weight_type, default_zero_mode(weight_type) if self.zero_mode is None else self.zero_mode)
        check_method(weight_type, self.method)

    def linear_options(self) -> dict:
        """Keyword arguments of bitkern.Linear / Linear.from_float."""
        options = asdict(self)
        del options["modules_to_not_convert"]
        return options

    def describe(self) -> str:
        return ", ".join(f"{name}={dtype_name(value) if isinstance(value, torch.dtype) else value}"
                         for name, value in asdict(self).items())
