"""A compiled CUDA kernel called on torch tensors, and the base of the CUDA templates, whose `build` lowers a
template's scheduled TIR with TVM and compiles the CUDA source with nvcc for the target architecture (no GPU
needed).

A `CudaKernel` has the call convention of the CPU kernels, `kernel(x2d, packed_weight, bias) -> y`, launched
through the driver API on torch's current stream with the tensors' device pointers (no copies); `plan` is the
same call up to the driver (its launches, arguments packed).  `CudaKernel.source` keeps the .cu,
`binary.ptx` the PTX, `binary.registers` ptxas' register counts.  `save` / `load_kernel` move a built
kernel to a machine with only a driver (no TVM, no nvcc: this module imports neither).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field

import torch

from ...ops.matmul import EPILOGUES, Matmul
from ...ttype import Layout, get, torch_dtype
from ..template import Template
from .compile import Binary, Launch, LaunchCall, check_arch, evaluate, lower, nvcc
from .expr import MAX_ROWS
from .layout import Lop3Weight

log = logging.getLogger("bitkern")

_ALIGNMENT = 16  # bytes: cp.async and 128-bit loads


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

    def __call__(self, x: torch.Tensor, weight: Lop3Weight, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """y[M, out_features] for a contiguous CUDA x[M, K] (inputs validated by the caller, as for the CPU
        kernels; residual: [M, out_features] in the output type, for specs with one)."""
        self._check_call(x, weight)
        self._check_device(x.device)
        return self.launch(x.device, *self.plan(x, weight, bias, residual))

    def launch(self, device: torch.device, y: torch.Tensor, calls) -> torch.Tensor:
        """Enqueue planned `calls` on torch's current stream of `device`; returns y."""
        module = self._module(device)
        stream = torch.cuda.current_stream(device).cuda_stream
        for call in calls:
            module.launch(call.name, call.grid, call.block, call.shared_bytes, stream, call.arguments,
                          call.static_shared_bytes)
        return y

    def plan(self, x: torch.Tensor, weight: Lop3Weight, bias: torch.Tensor | None = None,
             residual: torch.Tensor | None = None):
        """(y, [LaunchCall]): the output allocated on x's device and the launches that compute it, arguments
        packed (each call holds the tensors it points into); everything a call does but the driver calls (a dry
        run checks them against the cubin with host tensors, `launcher.check_launches`)."""
        return self._plan(x, weight, bias, residual, {})

    def output_rows(self, m: int) -> int:
        """Rows of the [rows, out_features] output a call with M rows of x writes."""
        return m

    def _plan(self, x: torch.Tensor, weight: Lop3Weight, bias: torch.Tensor | None, residual: torch.Tensor | None,
              extra: dict):
        """`plan` with `extra` {name: tensor} arguments beside the weight's (a grouped kernel's routing)."""
        self._check_call(x, weight)
        m, device = x.shape[0], x.device
        y = torch.empty(self.output_rows(m), self.spec.out_features(self.n), dtype=torch_dtype(self.spec.output_dtype),
                        device=device)
        tensors = {"x": x, "qweight": weight.qweight, "scales": weight.scales, "y": y, **extra}
        if weight.zeros is not None:
            tensors["zeros"] = weight.zeros
        if weight.tensor_scale is not None:
            tensors["tensor_scale"] = weight.tensor_scale.reshape(1)
        if bias is not None:
            tensors["bias"] = bias.to(torch.float32).contiguous()
        if (residual is not None) != self.spec.residual:
            raise ValueError(f"residual {'is required' if self.spec.residual else 'must be None'}: the kernel's spec "
                             f"has residual={self.spec.residual}")
        if residual is not None:
            if tuple(residual.shape) != tuple(y.shape) or residual.dtype != y.dtype:
                raise ValueError(f"residual must be a {y.dtype} tensor of shape {tuple(y.shape)}, got "
                                 f"{residual.dtype} {tuple(residual.shape)}")
            tensors["residual"] = residual
        for names, shape in self.config.workspace(self.n, self.k, m):  # float32 buffers the launches share
            buffer = torch.empty(shape, dtype=torch.float32, device=device)
            tensors.update(dict.fromkeys(names, buffer))
        for name, tensor in tensors.items():
            if not tensor.is_contiguous() or tensor.data_ptr() % _ALIGNMENT:
                raise ValueError(f"{name} must be contiguous and {_ALIGNMENT}-byte aligned for the kernel's vector "
                                 f"loads; pass {name}.contiguous() or a copy (.clone())")
        calls = []
        for launch in self.launches:
            arguments = [("int32", m) if name == "M" else ("pointer", tensors[name].data_ptr())
                         for name in launch.params]
            calls.append(LaunchCall(launch.name, tuple(evaluate(g, m) for g in launch.grid),
                                    tuple(evaluate(b, m) for b in launch.block), launch.shared_bytes,
                                    launch.static_shared_bytes, arguments, tuple(tensors.values())))
        return y, calls

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

    @staticmethod
    def _check_call(x: torch.Tensor, weight) -> None:
        if not 1 <= x.shape[0] <= MAX_ROWS:
            raise ValueError(f"x has {x.shape[0]} rows; a CUDA kernel serves 1 to {MAX_ROWS}")
        if not isinstance(weight, Lop3Weight):
            raise TypeError(f"weight must be packed in the 'lop3' layout (bitkern.codegen.cuda.pack), "
                            f"got {type(weight).__name__} layout {getattr(weight, 'layout', None)!r}")

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
    from . import TEMPLATES

    templates = {t.name: t for t in TEMPLATES}
    if template not in templates:
        raise ValueError(f"kernel.json describes a kernel of template {template!r}; accepted: {list(templates)}")
    chosen = templates[template]
    config = chosen.config_from_dict(description["config"])
    binary = Binary(description["arch"], cubin, ptx, description["registers"], description["spills"])
    return chosen.kernel_class(chosen.spec_class(**description["spec"]), description["n"], description["k"], template,
                               config, description["arch"], tuple(description["m_range"]),
                               source, [Launch.from_json(launch) for launch in description["launches"]], binary)


WARP = 32
# the epilogues an output stage computing each column on its own emits: SwiGLU pairs a gate and an up column
PER_COLUMN_EPILOGUES = tuple(name for name in EPILOGUES if name != "swiglu")
MAX_THREADS = 1024  # per thread block
DECODES = ("lop3", "tir")  # the LOP3 decode functions, or the same formula as plain TIR (any group size)


def check_positive(config, names: tuple[str, ...]) -> None:
    """Raise unless the fields `names` of a CUDA template configuration are positive ints."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")


def check_config(config, positive: tuple[str, ...]) -> None:
    """Raise unless the `positive` fields of a CUDA template configuration are positive ints and its decode is
    known."""
    check_positive(config, positive)
    if config.decode not in DECODES:
        raise ValueError(f"decode={config.decode!r} is not known; accepted: {list(DECODES)}")


@dataclass(frozen=True)
class Resources:
    """What one thread block of a kernel uses, to check against an architecture's limits."""

    shared_bytes: int
    threads: int
    registers: int

    def unfit(self, device) -> str | None:
        """Why a block using these resources cannot run on `device` (a tuner CudaDevice), or None."""
        if self.shared_bytes > device.shared_bytes_per_block:
            return f"{self.shared_bytes} bytes of shared memory > {device.shared_bytes_per_block}"
        if self.threads > device.max_threads_per_block:
            return f"{self.threads} threads > {device.max_threads_per_block}"
        if self.registers > device.registers_per_thread:
            return f"{self.registers} registers per thread > {device.registers_per_thread}"
        if self.registers * self.threads > device.registers_per_sm:
            return f"{self.registers * self.threads} registers per block > {device.registers_per_sm}"
        return None


class CudaTemplate(Template):
    """A CUDA template: schedules TIR functions (one per launch) over the "lop3" layout; `build` compiles them."""

    target = "cuda"
    layouts = (Layout.LOP3,)
    kernel_class = CudaKernel  # what `build` and `kernel_from_files` make
    spec_class = Matmul  # the spec its kernels serve (kernel.json stores its fields)
    epilogues = EPILOGUES  # the expression's output stage (`ops.expr.output_stage`, via `expr.cuda_matmul_expr`)
    residual_add = True

    @abc.abstractmethod
    def config_unsupported(self, spec: Matmul, n: int, k: int, config, arch: str) -> str | None:
        """Why `config` cannot build `spec` for a [N, K] weight (the spec itself being served), or None."""

    @abc.abstractmethod
    def functions(self, spec: Matmul, n: int, k: int, config, arch: str, prefix: str = "") -> dict:
        """The scheduled PrimFuncs of one kernel, {symbol: func} in launch order (symbols start with `prefix`)."""

    def reason(self, spec: Matmul, n: int, k: int, config, arch: str) -> str | None:
        """Why the template cannot build `spec` with `config` on `arch` (the spec, then the configuration), or
        None."""
        return self.spec_unsupported(spec, n, k, arch) or self.config_unsupported(spec, n, k, config, arch)

    @abc.abstractmethod
    def spec_unsupported(self, spec: Matmul, n: int, k: int, arch: str) -> str | None:
        """Why the template cannot serve `spec` on `arch` at all, or None."""

    def unsupported(self, spec: Matmul, n: int, k: int, device) -> str | None:
        return self.spec_unsupported(spec, n, k, device.arch)

    def checked(self, spec: Matmul, n: int, k: int, config, arch: str) -> None:
        """Raise (naming the template) unless `config` builds `spec` on `arch`."""
        check_arch(arch)
        self.check_config(config)
        reason = self.reason(spec, n, k, config, arch)
        if reason:
            raise ValueError(f"the {self.title} template does not support {reason}")

    def buildable(self, spec: Matmul, n: int, k: int, candidates, device) -> list:
        """The candidate configurations that build `spec` and fit the device's limits; the plain-TIR decode only
        where the LOP3 decode cannot serve (it is the slower, general path)."""
        found = [config for config in candidates if self.config_unsupported(spec, n, k, config, device.arch) is None
                 and self.resources(spec, k, config).unfit(device) is None]
        lop3 = {config for config in found if config.decode == "lop3"}
        return [config for config in found
                if config.decode == "lop3" or dataclasses.replace(config, decode="lop3") not in lop3]

    def build(self, spec: Matmul, n: int, k: int, config, layout, bucket: tuple[int, int], device,
              keep_dir: str | None = None) -> CudaKernel:
        """Generate the template's code for `config`, compile it with nvcc for `device.arch` (e.g. "sm_90")."""
        if layout != Layout.LOP3:
            raise ValueError(f"the {self.name} template reads the {Layout.LOP3} layout, not {layout!r}")
        arch = device.arch
        funcs = self.functions(spec, n, k, config, arch)
        source, launches = lower(funcs, arch)
        binary = nvcc(source, arch, keep_dir)
        ordered = [launch for symbol in funcs for launch in launches[symbol]]
        for launch in ordered:
            log.debug("bitkern: %s for %s: %d registers, %d bytes dynamic shared memory", launch.name, arch,
                      binary.registers.get(launch.name, -1), launch.shared_bytes)
        return self.kernel_class(spec, n, k, self.name, config, arch, bucket, source, ordered, binary)


def weight_bytes(spec: Matmul, n_pad: int, k_pad: int) -> float:
    """DRAM bytes of a padded weight's codes and scales."""
    return n_pad * k_pad * get(spec.weight_dtype).bits / 8 + n_pad * (k_pad // max(16, abs(spec.group_size))) * 2
