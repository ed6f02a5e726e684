"""The TVM passes a CPU kernel's build skips (kernel.SKIPPED_PASSES) only cost time: a kernel of each template
that builds on this machine compiles to the same machine code with them as without them.  A TVM upgrade that makes
one of them matter fails here."""

import pytest

from bitkern.codegen.cpu import TEMPLATES
from bitkern.codegen.cpu.compiler import compile_library
from bitkern.codegen.cpu.kernel import SKIPPED_PASSES, disassembly
from bitkern.tuner import host_cpu
from bitkern.tuner.space import enumerate_candidates
from tests.codegen.cpu.test_isa_levels import KERNELS, K, N

BUILDS_HERE = [template.name for template in TEMPLATES if not template.missing_features(host_cpu())]


@pytest.mark.parametrize("template", BUILDS_HERE)
def test_skipped_passes_leave_the_machine_code_unchanged(template):
    device = host_cpu()
    spec, rows = KERNELS[template]
    template_object = next(t for t in TEMPLATES if t.name == template)
    _, candidates = enumerate_candidates(spec, N, K, rows, "tile16", device)
    config = next(c.config for c in candidates if c.template == template)
    func, _ = template_object.program(spec, N, K, config, "tile16", rows, device)
    target = device.level.target_dict(device.cores)
    kept = ["s_tir.CompactBufferAllocation"] if template_object.exact_buffers else []
    code = [_instructions(compile_library(func, target, {"tirx.disable_cse_tir": True}, passes))
            for passes in (kept, kept + SKIPPED_PASSES)]
    assert code[0] == code[1]


def _instructions(library: str) -> list[str]:
    """The disassembly's lines without the one naming the library's file."""
    return [line for line in disassembly(library).splitlines() if library not in line]
