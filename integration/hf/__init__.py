"""bitkern in Hugging Face transformers: `BitkernConfig` as `from_pretrained(..., quantization_config=...)`
(quantize every nn.Linear on load), `save_pretrained` of the quantized model and `from_pretrained` of it.

`import bitkern` registers the method "bitkern" with transformers (`registration`, which imports no
transformers); `bitkern.BitkernConfig` is `config.BitkernConfig`.  The checkpoint format: `format`; the
quantizer: `quantizer.BitkernHfQuantizer`; LoRA adapters on bitkern layers: `lora.LoraLinear`.
"""


def __getattr__(name: str):
    if name == "BitkernConfig":
        from .config import BitkernConfig

        return BitkernConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
