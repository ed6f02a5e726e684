"""`BitkernConfig`: the `quantization_config` of `from_pretrained` that quantizes a model's nn.Linear layers
with bitkern, and the record of it in a saved checkpoint's config.json."""

from __future__ import annotations

import re

from transformers.utils.quantization_config import QuantizationConfigMixin

from ...nn.prepare import check_tokens
from ...ttype import TType, dtype_name
from ...ttype.quantize import CALIBRATED_METHODS
from .format import FORMAT, SETTINGS, LayerSettings

METHOD = "bitkern"
SOURCES = ("bitkern",)
_KEYS = ("quant_method", "format", "source", *SETTINGS, "modules_to_not_convert", "overrides")


class BitkernConfig(QuantizationConfigMixin):
    """Quantize every nn.Linear and every mixture-of-experts experts module (transformers' 3-D expert weights, as
    `bitkern.Experts`) of a model on load with bitkern (`import bitkern` registers it with transformers as the
    method "bitkern"):

        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=bitkern.BitkernConfig("nf4"))

    dtype, group_size, zero_mode, scale_dtype, compute_dtype, activation_quant: as for `bitkern.Linear` (group_size
    None: the type's default, -1: per channel; dtypes as torch dtypes or their names; activation_quant="int8":
    the layers quantize their input per 32 inputs to int8, as llama.cpp's Q8_0 activations).
    method: how the weights' scales and zeros are chosen on load (`bitkern.quantize`'s: "rtn", or "hqq": optimized
    per group without data); recorded in the saved config, and a checkpoint loads as stored (never re-run).
    modules_to_not_convert: modules kept float besides those transformers keeps by default (the output
    embedding lm_head, tied weights).  overrides: {pattern: {setting: value}} gives the modules a pattern
    matches other settings, e.g. {"down_proj": {"dtype": "int8"}} (the first matching pattern wins).  An experts
    module's projections take the settings of their float parameters' names ("...mlp.experts.gate_up_proj",
    "...mlp.experts.down_proj"), so {"experts": {"dtype": "int4"}} gives every experts module int4.
    A pattern (or name) is a regular expression matched against whole dot-separated parts of a module's
    name: "lm_head", "down_proj" (every layer's), "model.layers.0" (and everything in it),
    r"layers\\.(0|1)\\.mlp".
    source: the format of a pre-quantized checkpoint's tensors ("bitkern": what save_pretrained writes).
    prepare: token counts (an int or a sequence, e.g. (1, 512)) whose kernels `from_pretrained` makes ready before
    it returns the model (`bitkern.prepare`: loaded from the kernel caches or tuned), so that no call tunes; None
    (default) leaves each kernel to its first call.  A loading option: not saved with the checkpoint, and for a
    pre-quantized checkpoint transformers uses the checkpoint's config (call `bitkern.prepare(model, tokens)`
    after loading it).
    """

    def __init__(self, dtype="nf4", group_size: int | None = None, zero_mode: str | None = None,
                 compute_dtype=None, scale_dtype="float16", modules_to_not_convert: list[str] | None = None,
                 overrides: dict[str, dict] | None = None, source: str = "bitkern", activation_quant: str = "none",
                 prepare=None, method: str = "rtn"):
        self.quant_method = METHOD
        self.dtype = dtype.name if isinstance(dtype, TType) else dtype
        self.group_size, self.zero_mode = group_size, zero_mode
        self.scale_dtype, self.compute_dtype = dtype_name(scale_dtype), dtype_name(compute_dtype)
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.overrides = {pattern: dict(settings) for pattern, settings in (overrides or {}).items()}
        self.source = source
        self.activation_quant = activation_quant
        self.method = method
        self.prepare = None if prepare is None else check_tokens(prepare, "prepare")
        self._check()

    def _check(self) -> None:
        """Raise naming the field, before any model is touched, where a setting cannot work for any layer."""
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r} is not a known checkpoint format; accepted: {list(SOURCES)}")
        if not isinstance(self.modules_to_not_convert, list) or not all(
                isinstance(name, str) for name in self.modules_to_not_convert):
            raise TypeError(f"modules_to_not_convert must be a list of module names, got {self.modules_to_not_convert!r}")
        if not isinstance(self.overrides, dict):
            raise TypeError(f"overrides must be a dict {{pattern: {{setting: value}}}}, got {self.overrides!r}")
        for pattern in [*self.modules_to_not_convert, *self.overrides]:
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"module pattern {pattern!r} is not a regular expression: {error}") from None
        _check_settings("BitkernConfig", self.layer_settings(""))
        for pattern, settings in self.overrides.items():
            unknown = sorted(set(settings) - set(SETTINGS))
            if unknown:
                raise ValueError(f"overrides[{pattern!r}] has unknown settings {unknown}; accepted: {list(SETTINGS)}")
            _check_settings(f"overrides[{pattern!r}]", self.layer_settings(pattern, settings))

    def layer_settings(self, name: str, override: dict | None = None) -> LayerSettings:
        """The settings of the module called `name`: the first override whose pattern matches it, over the
        config's own (or `override` itself where given)."""
        if override is None:
            override = next((s for pattern, s in self.overrides.items() if matches(pattern, name)), {})
        own = {key: getattr(self, key) for key in SETTINGS}
        merged = {**own, **override}
        merged["scale_dtype"], merged["compute_dtype"] = (dtype_name(merged["scale_dtype"]),
                                                          dtype_name(merged["compute_dtype"]))
        return LayerSettings(**merged)

    def converts(self, name: str, kept: list[str]) -> bool:
        """Whether the module called `name` is quantized: unless a pattern in modules_to_not_convert or in
        `kept` (transformers' defaults) matches it."""
        return not any(matches(pattern, name) for pattern in [*self.modules_to_not_convert, *kept])

    def to_dict(self) -> dict:
        return {"quant_method": METHOD, "format": FORMAT, "source": self.source,
                **{key: getattr(self, key) for key in SETTINGS},
                "modules_to_not_convert": list(self.modules_to_not_convert),
                "overrides": {pattern: dict(settings) for pattern, settings in self.overrides.items()}}

    @classmethod
    def from_dict(cls, config_dict: dict, return_unused_kwargs: bool = False, **kwargs):
        """The config a dict from `to_dict` (a checkpoint's config.json) describes; ValueError naming unknown
        keys or a format this bitkern does not read."""
        if not isinstance(config_dict, dict):
            raise TypeError(f"a BitkernConfig is made from a dict, got {type(config_dict).__name__}")
        unknown = sorted(set(config_dict) - set(_KEYS))
        if unknown:
            raise ValueError(f"the bitkern quantization_config has unknown keys {unknown}; accepted: {list(_KEYS)}")
        if config_dict.get("quant_method", METHOD) != METHOD:
            raise ValueError(f"quant_method={config_dict['quant_method']!r} is not {METHOD!r}")
        if config_dict.get("format", FORMAT) != FORMAT:
            raise ValueError(f"the checkpoint has bitkern format {config_dict['format']!r}; this bitkern reads "
                             f"{FORMAT!r}")
        fields = {key: value for key, value in config_dict.items() if key not in ("quant_method", "format")}
        return super().from_dict(fields, return_unused_kwargs, **kwargs)

    def to_diff_dict(self) -> dict:
        return self.to_dict()


def matches(pattern: str, name: str) -> bool:
    """Whether `pattern` (a regular expression) matches a run of whole dot-separated parts of `name`."""
    return re.fullmatch(rf"(?:.*\.)?(?:{pattern})(?:\..*)?", name) is not None


def _check_settings(where: str, settings: LayerSettings) -> None:
    """Build a small layer with `settings` (on meta) so that a bad type, zero mode or dtype fails here, naming
    the setting; the group size is checked against each layer when the model is known."""
    group = settings.group_size if isinstance(settings.group_size, int) and settings.group_size > 0 else None
    try:
        LayerSettings(settings.dtype, group, settings.zero_mode, settings.scale_dtype, settings.compute_dtype,
                      settings.activation_quant, settings.method).layer(group or 512, 16)
        if settings.method in CALIBRATED_METHODS:
            raise ValueError(f"method={settings.method!r} needs calibration data, which quantize-on-load has none "
                             f"of; quantize with bitkern.quantize_model(model, method={settings.method!r}, "
                             f"calibration=...) and save that, or use method='rtn' or 'hqq'")
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from None
    if settings.group_size is not None and (isinstance(settings.group_size, bool) or not isinstance(
            settings.group_size, int) or not (settings.group_size > 0 or settings.group_size == -1)):
        raise ValueError(f"{where}: group_size={settings.group_size!r} must be a positive int, -1 (per channel) "
                         f"or None (the type's default)")
