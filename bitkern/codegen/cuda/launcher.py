"""A cubin launcher on the CUDA driver API (libcuda through ctypes): no TVM and no compiler at run time.

Modules are loaded once per (cubin, device) into the device's primary context (the one torch uses);
kernels are launched with `cuLaunchKernel` on the stream the caller passes (torch's current stream), so
they order with other torch work and can be captured in CUDA graphs.  `check_launches` is the dry run of a
launch: the kernel's name, its parameters' offsets and sizes (read from the cubin's ELF sections) and the launch
limits, checked without a driver.
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from dataclasses import dataclass

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


# -- dry runs: a launch checked against the cubin, no driver -------------------------------------------------------
_ARGUMENT_BYTES = {"pointer": 8, "int32": 4, "float32": 4}
_KPARAM_INFO = 0x17  # EIATTR_KPARAM_INFO in a kernel's .nv.info section: one record per parameter
_CBANK_PARAM_SIZE = 0x19  # EIATTR_CBANK_PARAM_SIZE: the parameters' bytes
_SVAL = 0x04  # attribute format with a payload of the size its header gives
_GRID_LIMITS = (2**31 - 1, 65535, 65535)
_BLOCK_LIMITS = (1024, 1024, 64)
_MAX_THREADS = 1024


@dataclass(frozen=True)
class Parameters:
    """A kernel's parameters as its cubin declares them: (offset, size) in the order of the signature, and their
    bytes in all."""

    layout: tuple
    total_bytes: int


def cubin_kernels(cubin: bytes) -> dict[str, Parameters]:
    """{kernel name: its Parameters} read from a cubin's ELF sections (.text.<name>, .nv.info.<name>)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    section_offset, = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, section_offset + i * entry_size) for i in range(count)]
    names_at = sections[names_index][4]

    def name_of(section) -> str:
        end = cubin.index(b"\0", names_at + section[0])
        return cubin[names_at + section[0]:end].decode()

    named = {name_of(section): cubin[section[4]:section[4] + section[5]] for section in sections}
    kernels = {}
    for name in (n[len(".text."):] for n in named if n.startswith(".text.")):
        info = named.get(f".nv.info.{name}", b"")
        parameters, total, at = {}, None, 0
        while at + 4 <= len(info):
            form, attribute, value = struct.unpack_from("<BBH", info, at)
            payload = info[at + 4:at + 4 + value] if form == _SVAL else b""
            if attribute == _KPARAM_INFO:
                _, ordinal, offset, flags = struct.unpack_from("<IHHI", payload)
                parameters[ordinal] = (offset, (flags >> 18) & 0x3FFF)
            elif attribute == _CBANK_PARAM_SIZE:
                total = value
            at += 4 + len(payload)
        kernels[name] = Parameters(tuple(parameters[i] for i in sorted(parameters)), total or 0)
    return kernels


def packed_layout(arguments) -> tuple:
    """(offset, size) of each (kind, value) argument as cuLaunchKernel passes them (each at its natural
    alignment)."""
    layout, offset = [], 0
    for kind, _ in arguments:
        size = _ARGUMENT_BYTES[kind]
        offset = -(-offset // size) * size
        layout.append((offset, size))
        offset += size
    return tuple(layout)


def check_launches(cubin: bytes, calls, shared_limit: int) -> None:
    """Raise ValueError unless every launch (a `compile.LaunchCall`) names a kernel of `cubin`, packs arguments of
    the offsets and sizes its parameters have, and fits the launch limits (`shared_limit`: bytes of shared
    memory a block may have on the device)."""
    kernels = cubin_kernels(cubin)
    for call in calls:
        where = f"launch of {call.name}"
        if call.name not in kernels:
            raise ValueError(f"{where}: the cubin has no such kernel (it has {sorted(kernels)})")
        declared, packed = kernels[call.name].layout, packed_layout(call.arguments)
        if declared != packed:
            raise ValueError(f"{where}: arguments packed as {packed}, the kernel's parameters are {declared}")
        if any(not 1 <= extent <= limit for extent, limit in zip(call.grid, _GRID_LIMITS)):
            raise ValueError(f"{where}: grid {call.grid} outside 1..{_GRID_LIMITS}")
        threads = call.block[0] * call.block[1] * call.block[2]
        if any(not 1 <= extent <= limit for extent, limit in zip(call.block, _BLOCK_LIMITS)) or threads > _MAX_THREADS:
            raise ValueError(f"{where}: block {call.block} outside 1..{_BLOCK_LIMITS}, {_MAX_THREADS} threads")
        if call.shared_bytes + call.static_shared_bytes > shared_limit:
            raise ValueError(f"{where}: {call.shared_bytes + call.static_shared_bytes} bytes of shared memory > "
                             f"{shared_limit}")
