"""Where a called spec goes: `bitkern.ops` describes operators and executes nothing itself.  The dispatch layer
(`bitkern.cache.dispatch`, imported by `import bitkern`) attaches the function that runs a call on its compiled
kernel; until then, calling a spec says what is missing."""

from __future__ import annotations


def run(spec, x, weight, bias=None, residual=None):
    """Run `spec(x, weight, bias, residual)`: replaced by the attached dispatch."""
    raise RuntimeError("no kernel dispatch is attached to bitkern.ops: import bitkern.cache (import bitkern does) "
                       "to run operators on their compiled kernels")


def run_grouped(spec, x, weight, indices, bias=None, weights=None):
    """Run a `GroupedMatmul` spec's `spec(x, weight, indices, bias, weights)`: replaced by the attached dispatch."""
    run(spec, x, weight, bias)  # raises as `run` does until a dispatch is attached


def attach(runner, grouped_runner=None) -> None:
    """Make `runner(spec, x, weight, bias, residual)` what calling a spec does (and `grouped_runner(spec, x, weight,
    indices, bias, weights)` what calling a `GroupedMatmul` does)."""
    global run, run_grouped
    run = runner
    if grouped_runner is not None:
        run_grouped = grouped_runner
