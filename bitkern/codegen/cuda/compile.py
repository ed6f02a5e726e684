"""From scheduled PrimFuncs to a cubin: TVM lowering and CUDA source, launch metadata, nvcc.

TVM does not call nvcc on a machine without a GPU (its CUDA module then holds source only), and its
runtime would compile at load time; bitkern compiles the source itself with nvcc for the target
architecture and keeps what a launcher needs next to the cubin: each kernel's name, parameters, grid
and block extents (as expressions of M) and dynamic shared memory.  No TVM is needed to run the result.
"""

from __future__ import annotations

import operator
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

from ..template import KernelBuildError

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_90a")
NVCC_FLAGS = ("-O3", "-ftz=false", "-prec-div=true", "-prec-sqrt=true", "-fmad=true", "-w")
_PASS_CONFIG = {"tirx.use_async_copy": True, "tirx.disable_cse_tir": True}
_THREAD_TAGS = ("blockIdx.x", "blockIdx.y", "blockIdx.z", "threadIdx.x", "threadIdx.y", "threadIdx.z")


@dataclass(frozen=True)
class Launch:
    """How to launch one kernel: `params` are argument names (tensors by their expression name, "M"),
    `grid` and `block` are integer expressions of M (see `evaluate`), `shared_bytes` the dynamic shared
    memory to launch with, `static_shared_bytes` the shared memory the kernel declares itself."""

    name: str
    params: tuple[str, ...]
    grid: tuple
    block: tuple
    shared_bytes: int
    static_shared_bytes: int

    def to_json(self) -> dict:
        return {"name": self.name, "params": list(self.params), "grid": list(self.grid), "block": list(self.block),
                "shared_bytes": self.shared_bytes, "static_shared_bytes": self.static_shared_bytes}

    @classmethod
    def from_json(cls, data: dict) -> "Launch":
        return cls(data["name"], tuple(data["params"]), tuple(_tuple(g) for g in data["grid"]),
                   tuple(_tuple(b) for b in data["block"]), int(data["shared_bytes"]),
                   int(data["static_shared_bytes"]))


@dataclass(frozen=True)
class LaunchCall:
    """One launch of a call, its extents evaluated and its arguments packed as (kind, value) pairs: kind
    "pointer", "int32" or "float32" (what `launcher.Module.launch` takes); `keep` holds the tensors the pointers point
    into, among them those the call allocated itself (split-K's partial sums, a float32 copy of the bias), so that
    their memory stays allocated until the launch is enqueued."""

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    static_shared_bytes: int
    arguments: list
    keep: tuple = field(default=(), repr=False, compare=False)


@dataclass(frozen=True)
class Binary:
    """nvcc's output for one source: the cubin, the PTX and ptxas' resource report per kernel."""

    arch: str
    cubin: bytes
    ptx: str
    registers: dict
    spills: dict


def check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; accepted: {list(ARCHS)}")
    return arch


def target(arch: str):
    import tvm

    return tvm.target.Target({"kind": "cuda", "arch": check_arch(arch)})


def lower(funcs: dict, arch: str) -> tuple[str, dict[str, list[Launch]]]:
    """CUDA source of the PrimFuncs {symbol: func} and, per symbol, its kernels' launches (in order)."""
    import tvm
    from tvm.tirx.build import codegen_build, split_host_device_mods

    cuda = target(arch)
    module = tvm.IRModule({symbol: func.with_attr("global_symbol", symbol) for symbol, func in funcs.items()})
    with tvm.transform.PassContext(config=_PASS_CONFIG):
        module = tvm.tirx.transform.BindTarget(cuda.with_host(tvm.target.Target({"kind": "llvm"})))(module)
        pipeline, _, finalize_device = tvm.tirx.get_default_tir_pipeline(cuda)
        module = pipeline(module)
        _, devices = split_host_device_mods(module)
        if len(devices) != 1:
            raise RuntimeError(f"expected one CUDA device module, got {len(devices)}")
        device_module = finalize_device()(next(iter(devices.values())))
        source = codegen_build(device_module, cuda).inspect_source()
    launches: dict[str, list[Launch]] = {symbol: [] for symbol in funcs}
    for global_var, func in sorted(device_module.functions.items(), key=lambda item: item[0].name_hint):
        name = str(func.attrs["global_symbol"])
        owner = max((s for s in funcs if name.startswith(s + "_")), key=len, default=None)
        if owner is None:
            raise RuntimeError(f"kernel {name!r} belongs to none of {sorted(funcs)}")
        launches[owner].append(_launch(name, func))
    return source, launches


def _launch(name: str, func) -> Launch:
    params = []
    for param in func.params:
        param_name = param.name
        if param_name.endswith("_ptr"):
            params.append(param_name[: -len("_ptr")])
        elif param_name == "M":
            params.append("M")
        else:
            raise RuntimeError(f"kernel {name} takes an unexpected parameter {param_name!r}")
    extents, shared = {}, {"shared.dyn": 0, "shared": 0}

    def visit(node):
        kind = type(node).__name__
        if kind == "AttrStmt" and node.attr_key == "thread_extent":
            tag = node.node.thread_tag
            extents.setdefault(tag, _expression(node.value))
        if kind == "AllocBuffer" and node.buffer.scope() in shared:
            size = 1
            for extent in node.buffer.shape:
                size *= int(extent)
            shared[node.buffer.scope()] += size * _bytes(str(node.buffer.dtype))
        for part in ("seq", "body", "then_case", "else_case"):
            child = getattr(node, part, None)
            if child is None:
                continue
            for item in (child if part == "seq" else [child]):
                visit(item)

    visit(func.body)
    grid = tuple(extents.get(tag, 1) for tag in _THREAD_TAGS[:3])
    block = tuple(extents.get(tag, 1) for tag in _THREAD_TAGS[3:])
    return Launch(name, tuple(params), grid, block, shared["shared.dyn"], shared["shared"])


def _bytes(dtype: str) -> int:
    bits = int(re.search(r"\d+", dtype).group()) if re.search(r"\d+", dtype) else 8
    return max(1, bits // 8)


_OPS = {"Add": "+", "Sub": "-", "Mul": "*", "FloorDiv": "//", "FloorMod": "%", "Min": "min", "Max": "max",
        "RShift": ">>", "LShift": "<<"}


def _expression(expr):
    """An integer TIR expression of M as a JSON-friendly tree: ints, "M", or (op, a, b)."""
    kind = type(expr).__name__
    if kind == "IntImm":
        return int(expr.value)
    if kind == "Var":
        if expr.name != "M":
            raise RuntimeError(f"launch extent depends on {expr.name!r}, not only on M")
        return "M"
    if kind == "Cast":
        return _expression(expr.value)
    if kind in _OPS:
        return (_OPS[kind], _expression(expr.a), _expression(expr.b))
    raise RuntimeError(f"cannot evaluate launch extent {expr} ({kind})")


def evaluate(expression, m: int) -> int:
    """Value of an expression tree from `_expression` for M = m (only the node's own operation is computed: the
    extents hold operands like min(M, 2**30), whose shift by the other operators would build huge integers)."""
    if isinstance(expression, int):
        return expression
    if expression == "M":
        return m
    return _EVALUATE[expression[0]](evaluate(expression[1], m), evaluate(expression[2], m))


_EVALUATE = {"+": operator.add, "-": operator.sub, "*": operator.mul, "//": lambda a, b: a // b if b else 0,
             "%": lambda a, b: a % b if b else 0, "min": min, "max": max, ">>": operator.rshift,
             "<<": operator.lshift}


def _tuple(value):
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value


def find_nvcc() -> str | None:
    """nvcc from $CUDA_HOME/bin, the PATH, or /usr/local/cuda/bin; None if there is none."""
    for candidate in (os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "nvcc"), shutil.which("nvcc") or "",
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def nvcc(source: str, arch: str, keep_dir: str | None = None) -> Binary:
    """Compile CUDA source to a cubin for `arch` (and keep the PTX and ptxas' report)."""
    compiler = find_nvcc()
    if compiler is None:
        raise RuntimeError("nvcc was not found (set CUDA_HOME or put nvcc on the PATH); it compiles bitkern's "
                           "CUDA kernels")
    check_arch(arch)
    with tempfile.TemporaryDirectory(prefix="bitkern-nvcc-") as scratch:
        work = keep_dir or scratch
        os.makedirs(work, exist_ok=True)
        source_path = os.path.join(work, "kernels.cu")
        with open(source_path, "w") as handle:
            handle.write(source)
        cubin_path = os.path.join(work, "kernels.cubin")
        command = [compiler, "-cubin", f"-arch={arch}", *NVCC_FLAGS, "-Xptxas", "-v", "--keep", "--keep-dir", work,
                   "-o", cubin_path, source_path]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise KernelBuildError(f"nvcc failed for {arch} ({' '.join(command)}):\n{result.stderr[-4000:]}")
        with open(cubin_path, "rb") as handle:
            cubin = handle.read()
        ptx_files = [f for f in os.listdir(work) if f.endswith(".ptx")]
        with open(os.path.join(work, ptx_files[0])) as handle:
            ptx = handle.read()
    registers, spills = _ptxas_report(result.stderr + result.stdout)
    return Binary(arch, cubin, ptx, registers, spills)


def _ptxas_report(text: str) -> tuple[dict, dict]:
    """Registers and spill bytes per kernel from `ptxas -v` output."""
    registers, spills, current = {}, {}, None
    for line in text.splitlines():
        entry = re.search(r"Compiling entry function '([^']+)'", line)
        if entry:
            current = entry.group(1)
        used = re.search(r"Used (\d+) registers", line)
        if used and current:
            registers[current] = int(used.group(1))
        spill = re.search(r"(\d+) bytes spill stores", line)
        if spill and current:
            spills[current] = int(spill.group(1))
    return registers, spills

