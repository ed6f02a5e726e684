"""Process-level prerequisites of the CPU kernels: the TVM runtime, one thread pool shared with torch, and
the AMX tile permission."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import platform

log = logging.getLogger("bitkern")

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_LAUNCHER = "bitkern.codegen.cpu._parallel_launch"
_CONTEXT_SYMBOLS = {"__TVMBackendParallelLaunch": "bitkern_parallel_launch",
                    "__TVMBackendParallelBarrier": "bitkern_parallel_barrier"}


@functools.lru_cache(maxsize=None)
def load_runtime() -> bool:
    """Load the TVM runtime (its symbols visible to kernel libraries), then send the parallel loops of every
    kernel loaded or compiled from now on to torch's OpenMP team.  True when they run there; False when they
    run on TVM's own thread pool (logged: the two pools then compete for the cores)."""
    ffi_library = _load_global("tvm_ffi", "libtvm_ffi.so")
    _load_global("tvm", "libtvm_runtime.so")  # registers TVM's pool as the launch: ours is registered after it
    reason = _torch_launch_unavailable()
    if reason is None:
        launcher = ctypes.CDLL(importlib.util.find_spec(_LAUNCHER).origin)
        for context_symbol, function in _CONTEXT_SYMBOLS.items():
            address = ctypes.cast(getattr(launcher, function), ctypes.c_void_p)
            if ffi_library.TVMFFIEnvModRegisterContextSymbol(context_symbol.encode(), address) != 0:
                raise RuntimeError(f"tvm-ffi refused the context symbol {context_symbol}")
        return True
    log.warning("bitkern: CPU kernels run on TVM's thread pool, which competes with torch's threads for the "
                "cores (set OMP_WAIT_POLICY=PASSIVE to soften it): %s", reason)
    return False


def load_library(path: str, name: str = "main"):
    """The function `name` of a kernel library exported by TVM (its parallel loops on torch's threads), loaded with
    the TVM runtime alone: a process that finds its kernels in the cache never imports the compiler.  A library of
    another architecture (cross-compiled for an aarch64 target on x86-64, say) is not loaded: its stand-in refuses
    every call."""
    import tvm_ffi

    arch = library_arch(path)
    if arch is not None and arch != _ELF_MACHINES.get(platform.machine()):
        return _Foreign(path, arch)
    load_runtime()
    return tvm_ffi.load_module(path)[name]


_ELF_MACHINES = {"x86_64": "x86_64", "AMD64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
_ELF_ARCHES = {62: "x86_64", 183: "aarch64"}  # e_machine: EM_X86_64, EM_AARCH64


def library_arch(path: str) -> str | None:
    """The architecture of an ELF shared library ("x86_64", "aarch64", or e_machine's number), or None for a file
    that is not ELF."""
    with open(path, "rb") as file:
        header = file.read(20)
    if len(header) < 20 or header[:4] != b"\x7fELF":
        return None
    machine = int.from_bytes(header[18:20], "little" if header[5] == 1 else "big")
    return _ELF_ARCHES.get(machine, str(machine))


class _Foreign:
    """A kernel library of another architecture, kept (for the disk cache, for another machine) but never run."""

    def __init__(self, path: str, arch: str):
        self.path, self.arch = path, arch

    def __call__(self, *arguments):
        raise RuntimeError(f"this kernel is {self.arch} code ({self.path}) and this machine is "
                           f"{platform.machine()}: it was built for another machine and is never run here")


def _torch_launch_unavailable() -> str | None:
    """Why the kernels cannot share torch's OpenMP team (None: they can), binding the launcher if they can."""
    import torch

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return "this torch build does not run its intra-op threads on OpenMP"
    spec = importlib.util.find_spec(_LAUNCHER)
    if spec is None or spec.origin is None:
        return (f"bitkern's compiled launcher {_LAUNCHER} is missing (it is built by `pip install` with a C "
                f"compiler present)")
    torch_cpu = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    status = ctypes.CDLL(spec.origin).bitkern_parallel_bind(torch_cpu.encode())
    if status != 0:
        return f"the OpenMP runtime of {torch_cpu} was not found (bind status {status})"
    return None


def _load_global(package: str, library: str) -> ctypes.CDLL:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {package!r} is not installed; bitkern's kernels need it")
    return ctypes.CDLL(os.path.join(spec.submodule_search_locations[0], "lib", library), mode=ctypes.RTLD_GLOBAL)


@functools.lru_cache(maxsize=None)
def enable_amx() -> None:
    """Ask Linux for permission to use AMX tile data in this process (needed once before any tile op)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        raise RuntimeError(f"the kernel refused AMX tile data to this process (errno {ctypes.get_errno()}); "
                           f"the AMX template needs Linux 5.16 or newer")
