"""bitkern: low-precision GEMM kernels for PyTorch — weights stored in custom types, decoded in the kernel."""

import os

import torch

# bitkern's kernels run their parallel loops on torch's own OpenMP threads (codegen.cpu.runtime); should they
# fall back to TVM's thread pool, that pool is sized once, from this variable: torch's intra-op thread count.
os.environ.setdefault("TVM_NUM_THREADS", str(torch.get_num_threads()))

from . import cache, ops, ttype  # noqa: E402  (after the thread count; importing cache attaches the dispatch to ops)
from .codegen import PackedWeight, pack  # noqa: E402
from .ttype import QuantizedWeight, quantize  # noqa: E402
from . import nn  # noqa: E402
from .nn import Conv2d, Experts, Linear, dequantize_model, load, quantize_model, save  # noqa: E402

from .integration.hf import registration as _hf_registration  # noqa: E402

_hf_registration.install()  # transformers finds bitkern checkpoints' method once it loads (imports no transformers)

__version__ = "0.1.0"


def fuse(model, *example_inputs, **options):
    """Rewrite `model`'s q/k/v, gate/up + SwiGLU, Linear + activation and norm -> Linear patterns in place into
    fused bitkern kernels where the cost model says they win (see `bitkern.fusion.fuse`, whose `patterns` option
    it takes); returns the model."""
    from .fusion import fuse as fuse_model

    return fuse_model(model, *example_inputs, **options)


def compile(model, **compile_options):
    """torch.compile `model`'s forward in place for inference, with the settings measured fastest for bitkern
    models: one graph with no guards on the model's own modules (so the model must not change afterwards: compile it
    last, and again after a change), Inductor's C++ wrapper on CPU and bitkern's Inductor pass (see
    `bitkern.fusion.compile`); returns the model.  compile_options: torch.compile's (`dynamic`, `mode`, `options`,
    ...)."""
    from .fusion.compile import compile_model

    return compile_model(model, **compile_options)


def prepare(model, tokens, dtype=None, progress: bool = True, warmup: bool = True, top_k=None):
    """Make ready every kernel a forward of `model` over `tokens` tokens calls (an int or a sequence of counts:
    batch x sequence length; each count's M bucket), loading it from the kernel caches (the user's, then the
    read-only system cache) or tuning and building it, with a progress bar, so that no call tunes; returns the
    summary (`bitkern.nn.prepare.PrepareReport`: kernels built, loaded, seconds).  dtype: the inputs' dtype
    (default: the model's).  A transformers model that runs bitkern's attention gets its decode-attention kernels
    too.  warmup: a transformers model then runs one forward per M bucket of the counts up to 128 tokens, so that
    its first call pays no first-call costs outside bitkern's kernels either (`bitkern.integration.hf.warmup`).
    top_k: the experts a token is routed to, for `bitkern.Experts` layers' grouped kernels (default: a transformers
    model's config.num_experts_per_tok).  Arguments are checked before any kernel is built."""
    import dataclasses
    import sys
    import time

    from .nn.prepare import input_dtype, prepare as prepare_model

    transformers = sys.modules.get("transformers")
    pretrained = transformers is not None and isinstance(model, transformers.PreTrainedModel)
    attention = ()
    if pretrained and model.config._attn_implementation == "bitkern":
        from .integration.hf.attention import decode_attention_specs

        attention = decode_attention_specs(model, input_dtype(model, dtype))
    if pretrained and top_k is None:
        top_k = getattr(model.config, "num_experts_per_tok", None)
    report = prepare_model(model, tokens, dtype, progress, attention, top_k)
    if not (pretrained and warmup):
        return report
    from .integration.hf.warmup import warm_up

    start = time.perf_counter()
    warmed = warm_up(model, report.tokens)
    return dataclasses.replace(report, warmed=warmed, seconds=report.seconds + time.perf_counter() - start)


def load_pretrained(path, **from_pretrained_kwargs):
    """A GPTQ / AWQ / bitsandbytes-4bit / gpt-oss MXFP4 checkpoint directory, or one `save_pretrained` of a bitkern
    model wrote, as a transformers model with bitkern layers (see `bitkern.integration.formats.pretrained`)."""
    from .integration.formats.pretrained import load_pretrained as load

    return load(path, **from_pretrained_kwargs)


def __getattr__(name: str):
    if name == "BitkernConfig":  # the transformers quantization config; importing it imports transformers
        try:
            from .integration.hf import BitkernConfig
        except ImportError as error:
            raise ImportError(f"bitkern.BitkernConfig needs transformers (pip install transformers): {error}") from error
        return BitkernConfig
    raise AttributeError(f"module 'bitkern' has no attribute {name!r}")


__all__ = ["Conv2d", "Experts", "Linear", "PackedWeight", "QuantizedWeight", "__version__", "compile",
           "dequantize_model", "fuse", "load", "load_pretrained", "nn", "ops", "pack", "prepare", "quantize",
           "quantize_model", "save", "ttype"]
