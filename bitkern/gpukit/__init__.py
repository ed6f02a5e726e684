"""A self-contained CUDA verification kit: kernels prebuilt here (TVM, nvcc, no GPU), run where only torch and a GPU
are (`python -m bitkern gpu-kit --arch sm_90 OUT`, then `OUT/run` there; `OUT/run --dry-run` checks it anywhere).

Entry points: `build(out, archs)` writes a kit (`build.py`); `matrix.requests(arch)` lists the kernels it holds;
`run.main` is the kit's entry script; `check` verifies a kit's kernels and launches without a GPU.
"""

from .build import build
from .check import check

__all__ = ["build", "check"]
