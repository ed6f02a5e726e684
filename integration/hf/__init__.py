"""bitkern in Hugging Face transformers: `BitkernConfig` as `from_pretrained(..., quantization_config=...)`
(quantize every nn.Linear on load), `save_pretrained` of the quantized model and `from_pretrained` of it.

`import bitkern` registers the method "bitkern" with transformers (`registration`, which imports no
transformers); `bitkern.BitkernConfig` is `config.BitkernConfig`.  The checkpoint format: `format`; the
quantizer: `quantizer.BitkernHfQuantizer`; LoRA adapters on bitkern layers: `lora.LoraLinear`; grouped-query
decoding attention without KV copies under torch.compile: `use_grouped_attention(model)` (`attention`).
"""


def __getattr__(name: str):
    if name == "BitkernConfig":
        from .config import BitkernConfig

        return BitkernConfig
    if name == "use_grouped_attention":
        from .attention import use_grouped_attention

        return use_grouped_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
