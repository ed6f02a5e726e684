"""Load compiled kernel libraries with the TVM runtime alone: a process that finds its kernels in the
cache never imports the compiler (importing it costs seconds; loading a kernel, milliseconds)."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os


@functools.lru_cache(maxsize=None)
def _load_runtime() -> None:
    """Make the TVM runtime's symbols (parallel launch, workspaces) visible to kernel libraries."""
    import tvm_ffi  # noqa: F401  (loads the FFI library the runtime links against)

    for package, library in (("tvm_ffi", "libtvm_ffi.so"), ("tvm", "libtvm_runtime.so")):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"package {package!r} is not installed; bitkern's kernels need it")
        ctypes.CDLL(os.path.join(spec.submodule_search_locations[0], "lib", library), mode=ctypes.RTLD_GLOBAL)


def load_function(path: str, name: str = "main"):
    """The function `name` of a kernel library exported by TVM."""
    import tvm_ffi

    _load_runtime()
    return tvm_ffi.load_module(path)[name]
