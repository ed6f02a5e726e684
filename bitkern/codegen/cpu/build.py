"""Compile a CPU template for one (spec, N, K) with TVM into a callable `CpuKernel`."""

from __future__ import annotations

import time

from ...ops.matmul import Matmul
from . import amx, dot, generic, lut
from .kernel import TEMPLATES, CpuKernel
from .runtime import load_runtime

# Templates written with TVM's IR builder: they read the tile16 layout and allocate their buffers at exact sizes.
_IR_BUILDER_TEMPLATES = {"amx": amx, "dot": dot, "lut": lut}


def build_kernel(spec: Matmul, n: int, k: int, template: str, config, layout: str, m_range: tuple[int, int],
                 device) -> CpuKernel:
    """Generate the template's code for `config` and compile it for `device` (a tuner CpuDevice)."""
    load_runtime()  # before TVM's compiler loads: the compiled module's parallel loops then run on torch's threads
    import tvm

    start = time.perf_counter()
    spec.check_shape(n, k)
    if template in _IR_BUILDER_TEMPLATES and layout != "tile16":
        raise ValueError(f"the {template} template reads the tile16 layout, not {layout!r}")
    constants = []
    if template in ("amx", "dot"):
        func = _IR_BUILDER_TEMPLATES[template].build(spec, n, k, config)
        if config.decode == "lut":
            constants.append(amx.lut_words(spec))
    elif template == "lut":
        func = lut.build(spec, n, k, config, device.cores, m_range)
        constants.append(lut.value_table(spec))
    elif template == "generic":
        func = generic.build(spec, n, k, config, layout)
    else:
        raise ValueError(f"template={template!r} is not known; accepted: {list(TEMPLATES)}")
    # LLVM eliminates common subexpressions itself; TVM's pass is slow on the unrolled templates.  Compacting the
    # IR-builder templates' exact buffers is a no-op that took ~40% of a large-M AVX512-BF16 kernel's compile
    # (measured: 0.74 -> 0.50 s, the same results bitwise).
    exact_buffers = ["s_tir.CompactBufferAllocation"] if template in _IR_BUILDER_TEMPLATES else []
    with tvm.transform.PassContext(config={"tirx.disable_cse_tir": True}, disabled_pass=exact_buffers):
        module = tvm.compile(tvm.IRModule({"main": func}), target=device.tvm_target())
    return CpuKernel(spec, n, k, template, config, layout, m_range, module["main"], constants, module=module,
                     build_seconds=time.perf_counter() - start)
