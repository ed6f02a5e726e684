"""Build a CUDA template for one (spec, N, K) into a cubin and call it on torch tensors.

`build_kernel` schedules the template (`gemm` or `gemv`), lowers it with TVM, compiles the CUDA source
with nvcc for the target architecture (no GPU needed), and returns a `CudaKernel`: the call convention of
the CPU kernels, `kernel(x2d, packed_weight, bias) -> y`, launched through the driver API on torch's
current stream with the tensors' device pointers (no copies).  `CudaKernel.source` keeps the .cu,
`binary.ptx` the PTX, `binary.registers` ptxas' register counts.  `save` / `load_kernel` move a built
kernel to a machine with only a driver (no TVM, no nvcc: this module imports neither).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field

import torch

from ...ops.matmul import Matmul
from . import gemm, gemv
from .compile import Binary, Launch, check_arch, evaluate, lower, nvcc
from .expr import MAX_ROWS
from .layout import Lop3Weight, padded_shape

log = logging.getLogger("bitkern")

TEMPLATES = ("gemm", "gemv")
_ALIGNMENT = 16  # bytes: cp.async and 128-bit loads
_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class CudaKernel:
    """A compiled kernel for weights of one spec and shape, serving rows M in `m_range` (inclusive)."""

    spec: Matmul
    n: int
    k: int
    template: str
    config: object
    arch: str
    m_range: tuple[int, int]
    source: str
    launches: list[Launch]
    binary: Binary
    _modules: dict = field(default_factory=dict, repr=False)

    def __call__(self, x: torch.Tensor, weight: Lop3Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y[M, N] for a contiguous CUDA x[M, K] (inputs validated by the caller, as for the CPU kernels)."""
        m = x.shape[0]
        if not 1 <= m <= MAX_ROWS:
            raise ValueError(f"x has {m} rows; a CUDA kernel serves 1 to {MAX_ROWS}")
        if not isinstance(weight, Lop3Weight):
            raise TypeError(f"weight must be packed in the 'lop3' layout (bitkern.codegen.cuda.pack), "
                            f"got {type(weight).__name__} layout {getattr(weight, 'layout', None)!r}")
        device = x.device
        self._check_device(device)
        y = torch.empty(m, self.n, dtype=_TORCH[self.spec.output_dtype], device=device)
        tensors = {"x": x, "qweight": weight.qweight, "scales": weight.scales, "y": y}
        if weight.zeros is not None:
            tensors["zeros"] = weight.zeros
        if weight.tensor_scale is not None:
            tensors["tensor_scale"] = weight.tensor_scale.reshape(1)
        if bias is not None:
            tensors["bias"] = bias.to(torch.float32).contiguous()
        if self.template == "gemv" and self.config.split_k > 1:
            rows = -(-m // self.config.rows) * self.config.rows
            partial = torch.empty(self.config.split_k, rows, padded_shape(self.n, self.k)[0], dtype=torch.float32,
                                  device=device)
            tensors["acc"] = tensors["partial"] = partial
        for name, tensor in tensors.items():
            if not tensor.is_contiguous() or tensor.data_ptr() % _ALIGNMENT:
                raise ValueError(f"{name} must be contiguous and {_ALIGNMENT}-byte aligned for the kernel's vector "
                                 f"loads; pass {name}.contiguous() or a copy (.clone())")
        module = self._module(device)
        stream = torch.cuda.current_stream(device).cuda_stream
        for launch in self.launches:
            arguments = []
            for name in launch.params:
                if name == "M":
                    arguments.append(("int32", m))
                else:
                    arguments.append(("pointer", tensors[name].data_ptr()))
            grid = [evaluate(g, m) for g in launch.grid]
            block = [evaluate(b, m) for b in launch.block]
            module.launch(launch.name, grid, block, launch.shared_bytes, stream, arguments,
                          launch.static_shared_bytes)
        return y

    def files(self) -> dict[str, bytes]:
        """kernel.cubin, kernel.ptx, kernel.cu and kernel.json: what `kernel_from_files` needs."""
        description = {"spec": dataclasses.asdict(self.spec), "n": self.n, "k": self.k, "template": self.template,
                       "config": dataclasses.asdict(self.config), "arch": self.arch, "m_range": list(self.m_range),
                       "launches": [launch.to_json() for launch in self.launches],
                       "registers": self.binary.registers, "spills": self.binary.spills}
        return {"kernel.cubin": self.binary.cubin, "kernel.ptx": self.binary.ptx.encode(),
                "kernel.cu": self.source.encode(), "kernel.json": json.dumps(description).encode()}

    def save(self, directory: str) -> None:
        """Write `files()` into `directory`: what `load_kernel` needs."""
        os.makedirs(directory, exist_ok=True)
        for name, content in self.files().items():
            with open(os.path.join(directory, name), "wb") as handle:
                handle.write(content)

    def _check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"x is on {device}; this kernel runs on CUDA devices")
        major, minor = torch.cuda.get_device_capability(device)
        want_major, want_minor = int(self.arch[3]), int(self.arch[4])
        if major != want_major or minor < want_minor:
            raise ValueError(f"this kernel is compiled for {self.arch}; {device} is sm_{major}{minor}")

    def _module(self, device: torch.device):
        from .launcher import module

        index = device.index if device.index is not None else torch.cuda.current_device()
        loaded = self._modules.get(index)
        if loaded is None:
            loaded = self._modules[index] = module(self.binary.cubin, index)
        return loaded


def load_kernel(directory: str) -> CudaKernel:
    """A kernel written by `CudaKernel.save`."""
    files = {}
    for name in ("kernel.json", "kernel.cubin", "kernel.ptx", "kernel.cu"):
        with open(os.path.join(directory, name), "rb") as handle:
            files[name] = handle.read()
    return kernel_from_files(files)


def kernel_from_files(files: dict[str, bytes]) -> CudaKernel:
    """A kernel from the contents of the files `CudaKernel.files` gives (e.g. as the kernel cache read and
    verified them)."""
    description = json.loads(files["kernel.json"])
    cubin, ptx, source = files["kernel.cubin"], files["kernel.ptx"].decode(), files["kernel.cu"].decode()
    template = description["template"]
    if template not in TEMPLATES:
        raise ValueError(f"kernel.json describes a kernel of template {template!r}; accepted: {list(TEMPLATES)}")
    config = (gemm.GemmConfig if template == "gemm" else gemv.GemvConfig)(**description["config"])
    binary = Binary(description["arch"], cubin, ptx, description["registers"], description["spills"])
    return CudaKernel(Matmul(**description["spec"]), description["n"], description["k"], template, config,
                      description["arch"], tuple(description["m_range"]),
                      source, [Launch.from_json(launch) for launch in description["launches"]], binary)


def build_kernel(spec: Matmul, n: int, k: int, template: str, config, arch: str, m_range: tuple[int, int],
                 keep_dir: str | None = None) -> CudaKernel:
    """Generate the template's code for `config`, compile it with nvcc for `arch` (e.g. "sm_90")."""
    funcs = kernel_functions(spec, n, k, template, config, arch)
    source, launches = lower(funcs, arch)
    binary = nvcc(source, arch, keep_dir)
    ordered = [launch for symbol in funcs for launch in launches[symbol]]
    for launch in ordered:
        log.debug("bitkern: %s for %s: %d registers, %d bytes dynamic shared memory", launch.name, arch,
                  binary.registers.get(launch.name, -1), launch.shared_bytes)
    return CudaKernel(spec, n, k, template, config, arch, m_range, source, ordered, binary)


def kernel_functions(spec: Matmul, n: int, k: int, template: str, config, arch: str, prefix: str = "") -> dict:
    """The scheduled PrimFuncs of one kernel, {symbol: func} in launch order (a GEMV with split-K has two)."""
    check_arch(arch)
    if template == "gemm":
        if not isinstance(config, gemm.GemmConfig):
            raise TypeError(f"config must be a GemmConfig for template 'gemm', got {type(config).__name__}")
        func = gemm.build(spec, n, k, config, arch)
        return {f"{prefix}gemm": func}
    if template == "gemv":
        if not isinstance(config, gemv.GemvConfig):
            raise TypeError(f"config must be a GemvConfig for template 'gemv', got {type(config).__name__}")
        func = gemv.build(spec, n, k, config)
        funcs = {f"{prefix}gemv": func}
        if config.split_k > 1:
            funcs[f"{prefix}gemv_reduce"] = gemv.build_reduce(spec, n, config)
        return funcs
    raise ValueError(f"template={template!r} is not known; accepted: {list(TEMPLATES)}")
