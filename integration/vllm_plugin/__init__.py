"""vLLM quantization plugin: `LLM(model, quantization="bitkern")` / `vllm serve MODEL --quantization bitkern`
quantizes a float checkpoint's linear layers on load and runs them on bitkern's kernels.

vLLM finds the plugin through the entry point group `vllm.general_plugins` (declared in setup.py) and calls
`register()` in each of its processes; registering again is harmless. Settings: see `Settings`.
"""

from .config import METHOD, SETTINGS_OVERRIDE, BitkernVllmConfig
from .linear_method import BitkernLinearMethod
from .settings import Settings

__all__ = ["METHOD", "SETTINGS_OVERRIDE", "BitkernLinearMethod", "BitkernVllmConfig", "Settings", "register"]


def register() -> None:
    """Add the quantization method "bitkern" to vLLM. Idempotent: registering the same class again only
    replaces the entry by itself."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    register_quantization_config(METHOD)(BitkernVllmConfig)
