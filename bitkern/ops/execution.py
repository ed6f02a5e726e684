"""Where a called spec goes: `bitkern.ops` describes operators and executes nothing itself.  The dispatch layer
(`bitkern.cache.dispatch`, imported by `import bitkern`) attaches the function that runs a call on its compiled
kernel; until then, calling a spec says what is missing."""

from __future__ import annotations


def run(spec, x, weight, bias=None):
    """Run `spec(x, weight, bias)`: replaced by the attached dispatch."""
    raise RuntimeError("no kernel dispatch is attached to bitkern.ops: import bitkern.cache (import bitkern does) "
                       "to run operators on their compiled kernels")


def attach(runner) -> None:
    """Make `runner(spec, x, weight, bias)` what calling a spec does."""
    global run
    run = runner
