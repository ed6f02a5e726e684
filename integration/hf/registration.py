"""Registers bitkern with transformers (`register_quantization_config` / `register_quantizer`, method
"bitkern") as soon as transformers' quantizer registry is imported, so that `import bitkern` is all a user
writes before `from_pretrained` of a bitkern checkpoint.  This module imports nothing of transformers: a
process that never loads a transformers model pays nothing, and one without transformers works as before.
"""

from __future__ import annotations

import importlib.abc
import logging
import sys

REGISTRY_MODULE = "transformers.quantizers.auto"
log = logging.getLogger("bitkern")


def install() -> None:
    """Register now if transformers' registry is already imported, else as soon as it is (an import hook on
    that one module, removed once it fires)."""
    if REGISTRY_MODULE in sys.modules:
        register()
    elif not any(isinstance(finder, _RegistryWatch) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegistryWatch())


def register() -> None:
    """Register BitkernConfig and BitkernHfQuantizer with transformers under "bitkern" (once)."""
    from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, register_quantization_config,
                                              register_quantizer)

    quantizer = sys.modules.get(f"{__package__}.quantizer")
    if quantizer is not None and not hasattr(quantizer, "BitkernHfQuantizer"):
        return  # the quantizer module's own import of transformers' quantizers got here: it registers at its end
    from .config import METHOD, BitkernConfig
    from .quantizer import BitkernHfQuantizer

    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(METHOD) is not BitkernConfig:
        register_quantization_config(METHOD)(BitkernConfig)
        register_quantizer(METHOD)(BitkernHfQuantizer)


class _RegistryWatch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when transformers' registry module is imported, it wraps the module's loader so that
    bitkern registers right after the module has run."""

    def find_spec(self, name, path, target=None):
        if name != REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisterAfter(spec.loader)
                return spec
        return None


class _RegisterAfter(importlib.abc.Loader):
    """A module loader that runs the module with its own loader, then registers bitkern."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            register()
        except Exception as error:  # transformers itself must import whatever bitkern's registration meets
            log.warning("bitkern: could not register with transformers (%s: %s); bitkern checkpoints will not "
                        "load through from_pretrained", type(error).__name__, error)
