"""bitkern's fusions inside vLLM's compiled model, through vLLM's own hook for a third-party Inductor pass
(`compilation_config.inductor_compile_config["post_grad_custom_post_pass"]`): no patching of vLLM.

vLLM already stacks q/k/v and gate/up into one layer each.  What is left is the SwiGLU epilogue: the merged
gate_up layer holds its rows in SwiGLU order (`bitkern.fusion.stack.swiglu_ordered`) and its output is read back
in vLLM's [gate; up] order (`unstack_swiglu`: views and a copy that Inductor fuses into SiluAndMul's ops), so that
bitkern's FusionPass can replace gate_up + SiluAndMul by one kernel with the SwiGLU epilogue; it also folds a
residual add or an activation into the linear before it.  Each rewrite is decided by bitkern's cost model, at one
row and at the row count vLLM compiles with.

The switch is the environment variable BITKERN_VLLM_FUSION (read in vLLM's worker processes, which inherit it):
  auto  (the default) fuse where the cost model says it wins, when vLLM compiles the model with Inductor (the CPU
        default); nothing changes in eager mode (enforce_eager) or with another backend;
  on    fuse every match, whatever the cost model says; an engine that does not compile with Inductor fails at
        start, saying why;
  off   never: gate_up keeps vLLM's row order and no pass is added.
Each decision is logged through vLLM's logger (pattern, row counts, modeled gain, fused or kept).
"""

from __future__ import annotations

import os

from vllm.compilation.passes.inductor_pass import InductorPass
from vllm.config import CompilationMode, VllmConfig
from vllm.logger import init_logger

from bitkern.fusion import FusionPass
from bitkern.fusion.inductor import epilogue_kernel_calls
from bitkern.nn.prepare import prepare_calls

SWITCH = "BITKERN_VLLM_FUSION"
CHOICES = ("auto", "on", "off")
PASS_KEY = "post_grad_custom_post_pass"
logger = init_logger("vllm.plugins.bitkern")  # under vLLM's logger, so its lines show with vLLM's own


class VllmFusionPass(InductorPass):
    """bitkern.fusion.FusionPass as vLLM takes a post-grad pass, logging each decision and making the fused calls'
    kernels ready at the engine's token counts `tokens` (the linear method prepares only its layer's own and the
    SwiGLU one; a residual add or an activation folded at the margin of the cost model would otherwise be tuned by
    the first request of another row count); a pass the user put in the same place runs first.  always: the switch
    is on (fuse every match)."""

    def __init__(self, tokens: tuple[int, ...], always: bool = False, user_pass=None):
        self.fusion = FusionPass(always)
        self.tokens, self.user_pass = tokens, user_pass

    def __call__(self, graph) -> None:
        if self.user_pass is not None:
            self.user_pass(graph)
        known = len(self.fusion.decisions)
        self.fusion(graph)
        for pattern, rows, gain, fused in self.fusion.decisions[known:]:
            logger.info("bitkern fusion: %s at %s rows, modeled gain %.3fx: %s", pattern,
                        " and ".join(map(str, rows)), gain, "fused" if fused else "kept unfused")
        calls = epilogue_kernel_calls(graph)
        if calls:
            report = prepare_calls(calls, self.tokens, progress=False)
            if report.built or report.loaded:
                logger.info("bitkern fusion: the fused calls' kernels: %s", report)

    def uuid(self) -> str:
        user = None
        if self.user_pass is not None:
            user = self.user_pass.uuid() if callable(getattr(self.user_pass, "uuid", None)) else \
                InductorPass.hash_source(self.user_pass)
        return InductorPass.hash_dict({"bitkern": self.fusion.uuid().hex(), "user": user})


def choice() -> str:
    """The switch's value; ValueError naming the accepted ones."""
    value = os.environ.get(SWITCH, "auto").strip().lower()
    if value not in CHOICES:
        raise ValueError(f"{SWITCH}={value!r} is not a choice; accepted: {list(CHOICES)} (auto: fuse where bitkern's "
                         f"cost model says it wins, in vLLM's compiled mode)")
    return value


def fusion_enabled(vllm_config: VllmConfig) -> bool:
    """Whether this engine fuses: the switch is not off and vLLM compiles the model with Inductor.  With the switch
    on, an engine that does not raises ValueError."""
    wanted = choice()
    compilation = vllm_config.compilation_config
    compiled = compilation.mode not in (None, CompilationMode.NONE) and compilation.backend == "inductor"
    if wanted == "on" and not compiled:
        how = "runs eager (enforce_eager or compilation mode NONE)" if compilation.mode in (None, CompilationMode.NONE) \
            else f"compiles with the backend {compilation.backend!r}"
        raise ValueError(f"{SWITCH}=on: bitkern's fusions need vLLM's compiled mode with the Inductor backend, but "
                         f"this engine {how}; use auto to fuse only where the engine compiles, or off")
    return wanted != "off" and compiled


def install(vllm_config: VllmConfig, tokens: tuple[int, ...]) -> VllmFusionPass:
    """Put a VllmFusionPass in vllm_config's Inductor post-grad pass (once; a user's pass there runs first), and
    return it; `tokens`: the engine's token counts.  Called while the model is built, before vLLM's compile wrapper
    reads the Inductor options."""
    options = vllm_config.compilation_config.inductor_compile_config
    current = options.get(PASS_KEY)
    if isinstance(current, VllmFusionPass):
        return current
    options[PASS_KEY] = VllmFusionPass(tokens, choice() == "on", current)
    return options[PASS_KEY]
