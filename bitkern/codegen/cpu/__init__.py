"""CPU kernel templates, compiled by TVM through LLVM: AMX (`amx`), AVX512-BF16 (`dot`), table lookup (`lut`), codes
converted for FMA (`fma`), VNNI for int8 activations (`vnni`), generic (`generic`), and grouped FMA and grouped VNNI
for mixture-of-experts decode (`grouped`, `grouped_vnni`), each one `CpuTemplate` object (`kernel.py`) whose TIR
comes from `emit`, each declaring the instruction-set features it needs (`isa.py`); the tile16 weight layout
(`layout.py`); the decode-attention kernel (`attention.py`, not a template: one kernel per spec, nothing to tune).
Kernels compile in a worker process (`compiler.py`).

The registry: `TEMPLATES`, in the order the tuner lists them.  A template is a module here that defines
`TEMPLATE`; adding one is that module and its name in the line below.
"""

from importlib import import_module

TEMPLATES = [import_module(f"{__name__}.{name}").TEMPLATE
             for name in ("amx", "dot", "lut", "fma", "vnni", "generic", "grouped", "grouped_vnni")]
