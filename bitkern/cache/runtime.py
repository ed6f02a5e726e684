"""Load compiled kernel libraries with the TVM runtime alone: a process that finds its kernels in the
cache never imports the compiler (importing it costs seconds; loading a kernel, milliseconds)."""

from __future__ import annotations

from ..codegen.cpu.runtime import load_runtime


def load_function(path: str, name: str = "main"):
    """The function `name` of a kernel library exported by TVM (its parallel loops on torch's threads)."""
    import tvm_ffi

    load_runtime()
    return tvm_ffi.load_module(path)[name]
