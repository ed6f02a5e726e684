"""Fusion: bitkern kernels that do more per call (epilogues in the kernel's output stage, GEMMs stacked over a
shared input) put where a cost model says they win.

Entry points: `bitkern.fuse(model, *example_inputs)` rewrites an eager model's known patterns in place;
`bitkern.fusion.explain(model, *example_inputs)` reports each candidate group, the decision and its gain;
`install()` appends the Inductor post-grad pass (`FusionPass`) that fuses residual adds into bitkern kernels
under torch.compile; `bitkern.compile(model)` (`compile.compile_model`) compiles a model's forward with that pass and
the settings measured fastest for inference.
"""

from .inductor import FusionPass, install
from .plan import Report, candidates, explain, fuse

__all__ = ["FusionPass", "Report", "candidates", "explain", "fuse", "install"]
