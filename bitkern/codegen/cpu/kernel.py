"""A compiled CPU kernel called on torch tensors (zero-copy through DLPack; the call needs no TVM compiler), and
what the CPU templates share: their base class, whose `build` compiles a template's TIR with LLVM in one
place, and the pieces of their configuration spaces and cost counts that are the same for all of them."""

from __future__ import annotations

import abc
import shutil
import time
from dataclasses import dataclass, field

import torch

from ...ops.matmul import Matmul
from ...ttype import Layout, effective_group_size, get, itemsize, torch_dtype
from ..template import Template
from .layout import PackedWeight, aligned
from .compiler import compile_library
from .runtime import enable_amx, load_library

PREFETCH_WORDS = (0, 16, 32, 64, 128)  # software prefetch depths the tuner may pick; 0: the hardware prefetchers
FEW_ROWS = 4  # rows up to which the few-row kernels compete (the lookup template, direct AVX512-BF16 blocks)
SMALL_M = 16  # rows up to which a kernel computes all of M in one block (one AMX tile of rows)
LARGE_M = 128  # rows beyond which row chunks may build their own activation planes (chunk_prologue)


@dataclass
class CpuKernel:
    """A compiled kernel for weights of one spec and shape, serving rows M in `m_range` (inclusive).

    constants: tensors the template takes after the weight's (decode tables), made when it was built;
    amx_tiles: the kernel uses AMX tile registers, which Linux grants a process on request.
    """

    spec: Matmul
    n: int
    k: int
    template: str
    config: object
    layout: str
    m_range: tuple[int, int]
    function: object
    constants: list = field(default_factory=list)
    record: object = None
    library: str | None = None  # its shared library's path, where this process compiled it (for the disk cache)
    build_seconds: float | None = None  # code generation and compilation, where this process compiled it
    amx_tiles: bool = False

    def __call__(self, x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, norm: tuple = ()) -> torch.Tensor:
        """y[M, N] for a contiguous x (x[M, K], or a convolution's NHWC image: M = its output pixels) with M
        in m_range (inputs already validated by the caller; residual: [M, N] in the output type, for specs with
        one; norm: (weight, bias or None) of a norm prologue, [K] each, passed as float32).  AMX kernels ask for the
        tile permission here, on their first call, so that they can be built for a CPU that is not this one."""
        self.check_rows(self.spec.rows(x))
        if self.amx_tiles:
            enable_amx()
        return self.run(x, (*weight.kernel_arguments(), *self.constants), bias, residual, norm)

    def run(self, x: torch.Tensor, arguments: tuple, bias: torch.Tensor | None = None,
            residual: torch.Tensor | None = None, norm: tuple = ()) -> torch.Tensor:
        """The call on x's rows with the weight's kernel arguments and the constants (`arguments`), rows and inputs
        as `__call__` has checked them (or as a bound call's first call had, `bitkern.cache.bound`)."""
        y = torch.empty(self.spec.rows(x), self.spec.out_features(self.n), dtype=torch_dtype(self.spec.output_dtype),
                        device=x.device)
        bias_argument = () if bias is None else (_float32(bias),)
        residual_argument = () if residual is None else (aligned(residual.contiguous()),)
        norm_arguments = tuple(_float32(vector) for vector in norm if vector is not None)
        self.function(aligned(x), *arguments, *norm_arguments, *bias_argument, *residual_argument, y)
        return y

    def check_rows(self, rows: int) -> None:
        """Raise unless this kernel serves `rows` rows (its m_range)."""
        if not self.m_range[0] <= rows <= self.m_range[1]:
            raise ValueError(f"x has {rows} rows; this {self.template} kernel serves {self.m_range[0]} to "
                             f"{self.m_range[1]} (ask the cache for the kernel of {rows} rows)")


def _float32(vector: torch.Tensor) -> torch.Tensor:
    """A bias or norm vector as the kernels take it: float32, contiguous and aligned (converted exactly)."""
    return aligned(vector if vector.dtype == torch.float32 and vector.is_contiguous() else vector.float().contiguous())


@dataclass(frozen=True)
class Footprint:
    """Bytes one task of a CPU kernel keeps in L1 and in L2 (its decoded stages, tables, accumulators)."""

    l1_bytes: int = 0
    l2_bytes: int = 0


class CpuTemplate(Template):
    """A CPU template: emits a TIR function (and the constant tensors it takes after the weight's) that LLVM
    compiles for the device.  amx_tiles: its kernels use AMX tile registers; exact_buffers: it allocates its
    buffers at their exact sizes (written with TVM's IR builder), so TVM's buffer compaction is skipped."""

    target = "cpu"
    kernel_class = CpuKernel  # what `build` and `restore` give (a grouped template's kernel takes the routing too)
    layouts = (Layout.TILE16,)
    amx_tiles = False
    exact_buffers = True

    @abc.abstractmethod
    def program(self, spec: Matmul, n: int, k: int, config, layout: Layout, bucket: tuple[int, int], device):
        """(the TIR PrimFunc of the kernel, the constant tensors it takes after the weight's)."""

    def build(self, spec: Matmul, n: int, k: int, config, layout: Layout, bucket: tuple[int, int],
              device) -> CpuKernel:
        """Generate the template's code for `config` and compile it for `device` (a tuner CpuDevice)."""
        start = time.perf_counter()
        spec.check_shape(n, k)
        missing = self.missing_features(device)
        if missing:
            raise ValueError(f"the {self.title} template cannot build for {missing}")
        if layout not in self.layouts:
            raise ValueError(f"the {self.name} template reads the {' or '.join(self.layouts)} layout, not {layout!r}")
        func, constants = self.program(spec, n, k, config, layout, bucket, device)
        library = compile_function(func, device, self.exact_buffers)
        return self.kernel_class(spec, n, k, self.name, config, layout, bucket, load_library(library), constants,
                                 library=library, build_seconds=time.perf_counter() - start, amx_tiles=self.amx_tiles)

    def restore(self, spec: Matmul, n: int, k: int, fields: dict, layout: str, m_range: tuple[int, int], function,
                constants: list) -> CpuKernel:
        """The kernel of a library compiled earlier (by `build`, in this or another process) and loaded since."""
        return self.kernel_class(spec, n, k, self.name, self.config_from_dict(fields), layout, m_range, function,
                                 constants, amx_tiles=self.amx_tiles)


# TVM passes that leave a CPU kernel's machine code as it is but cost build time on the unrolled templates: LLVM
# removes the no-ops and narrows the index arithmetic itself, and the others act on GPU annotations (virtual
# threads, permuted shared-memory layouts, software pipelines) that CPU kernels never carry.  Measured on 425
# kernels built by tests/codegen/cpu (every template, the x86 levels and two aarch64 ones): the same assembly in
# 0.83x the compile time (tests/codegen/cpu/test_compile_passes.py keeps checking a kernel of each template).
SKIPPED_PASSES = ["tirx.RemoveNoOp", "tirx.NarrowDataType", "s_tir.InjectVirtualThread",
                  "s_tir.InjectPermutedLayout", "s_tir.InjectSoftwarePipeline"]


def compile_function(func, device, exact_buffers: bool) -> str:
    """The path of the shared library LLVM makes of a kernel's PrimFunc for `device`'s instruction-set level,
    compiled out of this process (`compiler`: an LLVM abort raises KernelBuildError here instead of ending it).
    LLVM eliminates common subexpressions itself; TVM's pass is slow on the unrolled templates.  Compacting the
    IR-builder templates' exact buffers is a no-op that took ~40% of a large-M AVX512-BF16 kernel's compile
    (measured: 0.74 -> 0.50 s, the same results bitwise)."""
    skipped = SKIPPED_PASSES + (["s_tir.CompactBufferAllocation"] if exact_buffers else [])
    return compile_library(func, device.level.target_dict(device.cores), {"tirx.disable_cse_tir": True}, skipped)


def disassembly(library: str) -> str:
    """The machine code of a compiled kernel library, disassembled by binutils' objdump (AT&T syntax)."""
    import subprocess

    objdump = shutil.which("objdump")
    if objdump is None:
        raise RuntimeError("objdump (binutils) is needed to disassemble a kernel library; install binutils")
    return subprocess.run([objdump, "-d", "--no-show-raw-insn", library], check=True, capture_output=True,
                          text=True).stdout


def doublings(start: int, limit: int) -> list[int]:
    """start, 2·start, 4·start, ... up to limit (start at least 1)."""
    values, value = [], max(1, start)
    while value <= limit:
        values.append(value)
        value *= 2
    return values


def operand_bytes(spec: Matmul, n: int, k: int, m: int) -> float:
    """DRAM bytes of reading the weight (codes and scales) and x once and writing y (float32)."""
    ttype = get(spec.weight_dtype)
    groups = k // effective_group_size(spec.group_size, k)
    scale_bytes = 1 if ttype.block_size > 1 else itemsize(spec.scale_dtype)
    return n * k * ttype.bits / 8 + n * groups * scale_bytes + m * k * itemsize(spec.activation_dtype) + m * n * 4


def bfloat16_codes(ttype) -> bool:
    """Whether a type's 16-bit codes are bfloat16 bit patterns: the top half of their float32 values, which the
    kernels read by moving them there (a shift or a mask), no table."""
    return ttype.bits == 16 and ttype.float_format == get("bfloat16").float_format


def norm_prologue(spec: Matmul, m: int, k: int, copies: float) -> dict:
    """The operations of a norm prologue: each of x's M·K elements normalized `copies` times per call (by every
    thread that builds its own tables, or one thread's worth per core where a serial prologue keeps the others
    waiting)."""
    return {} if spec.norm == "none" else {"norm_prologue_element": m * k * copies}


def check_prefetch(prefetch: int) -> None:
    """Raise unless `prefetch` is a prefetch depth (weight words ahead)."""
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r} is not accepted: weight words ahead, an int >= 0 (0: no software "
                         f"prefetch, the hardware prefetchers alone)")
