"""A cubin launcher on the CUDA driver API (libcuda through ctypes): no TVM and no compiler at run time.

Modules are loaded once per (cubin, device) into the device's primary context (the one torch uses);
kernels are launched with `cuLaunchKernel` on the stream the caller passes (torch's current stream), so
they order with other torch work and can be captured in CUDA graphs.
"""

from __future__ import annotations

import ctypes
import functools
import threading

_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_ARGUMENT_TYPES = {"pointer": ctypes.c_void_p, "int32": ctypes.c_int32, "float32": ctypes.c_float}
_DEFAULT_SHARED_LIMIT = 48 * 1024


class CudaError(RuntimeError):
    """A CUDA driver API call failed."""


@functools.lru_cache(maxsize=None)
def _driver():
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        raise CudaError("the CUDA driver (libcuda.so) is not available on this machine")
    _check(lib, lib.cuInit(0), "cuInit")
    return lib


def _check(lib, status: int, call: str) -> None:
    if status:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(status, ctypes.byref(name))
        raise CudaError(f"{call} failed: {name.value.decode() if name.value else status}")


class Module:
    """A cubin loaded on one device; `launch` runs one of its kernels."""

    def __init__(self, cubin: bytes, device_index: int):
        self.lib = _driver()
        self.device_index = device_index
        self._functions: dict[str, ctypes.c_void_p] = {}
        self._context = self._primary_context()
        self._activate()
        self._image = ctypes.create_string_buffer(cubin, len(cubin))
        self.handle = ctypes.c_void_p()
        _check(self.lib, self.lib.cuModuleLoadData(ctypes.byref(self.handle), self._image), "cuModuleLoadData")

    def _primary_context(self):
        device = ctypes.c_int()
        _check(self.lib, self.lib.cuDeviceGet(ctypes.byref(device), self.device_index), "cuDeviceGet")
        context = ctypes.c_void_p()
        _check(self.lib, self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
        return context

    def _activate(self) -> None:
        current = ctypes.c_void_p()
        _check(self.lib, self.lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value != self._context.value:
            _check(self.lib, self.lib.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def function(self, name: str, shared_bytes: int, static_shared_bytes: int = 0) -> ctypes.c_void_p:
        """The kernel `name`, allowed `shared_bytes` of dynamic shared memory (beyond the default 48 KB per
        block, counting the kernel's static shared memory, the attribute must be raised)."""
        function = self._functions.get(name)
        if function is None:
            function = ctypes.c_void_p()
            _check(self.lib, self.lib.cuModuleGetFunction(ctypes.byref(function), self.handle, name.encode()),
                   f"cuModuleGetFunction({name})")
            if shared_bytes + static_shared_bytes > _DEFAULT_SHARED_LIMIT:
                _check(self.lib, self.lib.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED, shared_bytes),
                       f"cuFuncSetAttribute({name}, max dynamic shared memory = {shared_bytes})")
            self._functions[name] = function
        return function

    def launch(self, name: str, grid, block, shared_bytes: int, stream: int, arguments,
               static_shared_bytes: int = 0) -> None:
        """Launch kernel `name` with `shared_bytes` of dynamic shared memory; `arguments` are (kind, value)
        pairs, kind "pointer", "int32" or "float32"."""
        self._activate()
        function = self.function(name, shared_bytes, static_shared_bytes)
        holders = [_ARGUMENT_TYPES[kind](value) for kind, value in arguments]
        params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders])
        _check(self.lib, self.lib.cuLaunchKernel(function, *[ctypes.c_uint(int(g)) for g in grid],
                                                 *[ctypes.c_uint(int(b)) for b in block], ctypes.c_uint(shared_bytes),
                                                 ctypes.c_void_p(stream), params, None), f"cuLaunchKernel({name})")


_modules: dict = {}
_lock = threading.Lock()


def module(cubin: bytes, device_index: int) -> Module:
    """The loaded module of `cubin` on device `device_index` (loaded once per process)."""
    key = (hash(cubin), len(cubin), device_index)
    loaded = _modules.get(key)
    if loaded is None:
        with _lock:
            loaded = _modules.get(key)
            if loaded is None:
                loaded = _modules[key] = Module(cubin, device_index)
    return loaded
