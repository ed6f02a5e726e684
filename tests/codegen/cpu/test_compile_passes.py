"""The TVM passes a CPU kernel's build skips (kernel.SKIPPED_PASSES) only cost time: a kernel of each template
that builds on this machine compiles to the same machine code with them as without them.  A TVM upgrade that makes
one of them matter fails here."""

import pytest

from bitkern.codegen.cpu import TEMPLATES, kernel
from bitkern.codegen.cpu.kernel import compile_function, disassembly
from bitkern.tuner import host_cpu
from bitkern.tuner.space import enumerate_candidates
from tests.codegen.cpu.test_isa_levels import KERNELS, K, N

BUILDS_HERE = [template.name for template in TEMPLATES if not template.missing_features(host_cpu())]


@pytest.mark.parametrize("template", BUILDS_HERE)
def test_skipped_passes_leave_the_machine_code_unchanged(template, monkeypatch):
    device = host_cpu()
    spec, rows = KERNELS[template]
    template_object = next(t for t in TEMPLATES if t.name == template)
    _, candidates = enumerate_candidates(spec, N, K, rows, "tile16", device)
    config = next(c.config for c in candidates if c.template == template)
    func, _ = template_object.program(spec, N, K, config, "tile16", rows, device)
    skipping = _instructions(compile_function(func, device, template_object.exact_buffers))
    monkeypatch.setattr(kernel, "SKIPPED_PASSES", [])
    assert _instructions(compile_function(func, device, template_object.exact_buffers)) == skipping


def _instructions(library: str) -> list[str]:
    """The disassembly's lines without the one naming the library's file."""
    return [line for line in disassembly(library).splitlines() if library not in line]
