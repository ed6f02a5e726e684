"""The kernel-template protocol: what every template of every target exposes, so that the tuner, the cache
and the dispatch work with any of them through one interface (in the spirit of TVM dlight's ScheduleRule,
with a registry per target: `bitkern.codegen.cpu.TEMPLATES`, `bitkern.codegen.cuda.TEMPLATES`).

A template says which calls it can serve (`unsupported`), which configurations it can be built with
(`configs`, grown from the tuner's device hint while they fit the device), what one unit of its work holds
(`resources`: the one footprint the configuration space and the cost model both use), what a call does
(`work`: counts the tuner's cost model prices with its own figures per operation), and builds a kernel
(`build`).  The tuner keeps the policy: hints, prices, the shortlist, timing.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

from ..ttype import Layout

ANY_ROWS = 2**31 - 1


class KernelBuildError(RuntimeError):
    """A kernel failed to compile: the compiler refused it, or ended the process compiling it."""


@dataclass(frozen=True)
class Work:
    """What one call of a template configuration does, for the tuner's cost model.

    tasks: parallel tasks (CPU) or thread blocks (CUDA); dram_bytes: bytes moved from and to DRAM;
    operations: {operation: count}, each operation priced by the tuner for the device kind; bounds: groups
    of operations issued side by side, each group costing its slowest member; l1_bytes / l1_budget: the
    footprint a CPU task keeps in L1 and the part of L1 it may take before it slows the streams through the
    rest; streams / prefetch: weight streams a task reads at once and the words ahead it prefetches (None:
    the template has no prefetch knob); stream_penalty: the DRAM time added per doubling of the streams, where the
    template measured it (more streams are faster in the FMA templates); per_block: what one CUDA thread block holds
    (occupancy).
    """

    tasks: int
    dram_bytes: float
    operations: dict = field(default_factory=dict)
    bounds: tuple = ()
    l1_bytes: float = 0.0
    l1_budget: float = 0.0
    streams: int = 1
    prefetch: int | None = None
    stream_penalty: float = 0.0
    per_block: object = None


class Template(abc.ABC):
    """One kernel template of one target.

    name: its key in the registry, the cache and tuning records; title: its name in messages; target: "cpu"
    or "cuda"; layouts: the weight layouts it reads; config_type: its configuration (a frozen dataclass,
    stored in the cache by its fields); max_rows: the largest M it is a candidate for; epilogues, residual_add: the
    Matmul epilogues its output stage emits, norms / activation_quants: the norm prologues and activation
    quantizations it applies (`unsupported_epilogue`); requires: the CPU features its code needs (`missing_features`);
    shape_fields: the configuration fields that make two candidates differ in more than the cost model can rank
    (the tuner times such candidates first); grouped: it serves grouped specs only (`unsupported_grouping`).
    """

    name: str
    title: str
    target: str
    layouts: tuple[Layout, ...]
    config_type: type
    max_rows: int = ANY_ROWS
    shape_fields: tuple[str, ...] = ()
    epilogues: tuple[str, ...] = ("none",)  # the Matmul epilogues its output stage emits
    residual_add: bool = False  # it adds a residual tensor in its output stage
    norms: tuple[str, ...] = ("none",)  # the Matmul norm prologues it applies to x
    activation_quants: tuple[str, ...] = ("none",)  # the Matmul activation quantizations its prologue applies
    # the CPU features its code needs, one set per architecture it compiles for (`codegen.cpu.isa`, /proc/cpuinfo
    # names); () for any CPU
    requires: tuple[frozenset, ...] = ()
    grouped: bool = False  # it serves grouped specs (rows routed to stacked experts, `ops.GroupedMatmul`), no others

    def runs_at(self, level) -> bool:
        """Whether CPUs of the instruction-set `level` (`codegen.cpu.isa`) run the template's code."""
        return not self.requires or any(needs <= level.features for needs in self.requires)

    def missing_features(self, device) -> str | None:
        """Why the device's instruction-set level cannot run the template's code (the features it lacks, or that
        the template is code of another architecture), or None."""
        if device.kind != "cpu" or self.runs_at(device.level):
            return None
        from .cpu.isa import architecture

        needs = next((features for features in self.requires if architecture(features) == device.level.arch), None)
        if needs is None:
            arches = " and ".join(sorted(architecture(features) for features in self.requires))
            return f"the {device.level.name} level ({device.level.arch}; the {self.title} template is {arches} code)"
        return f"the {device.level.name} level (it needs {', '.join(sorted(needs - device.flags))})"

    def unsupported_rows(self, bucket: tuple[int, int], device) -> str | None:
        """Why the template does not serve the M bucket `bucket` on the device (beyond max_rows), or None."""
        if bucket[1] > self.max_rows:
            return f"{bucket[1]} rows (the {self.title} template serves at most {self.max_rows})"
        return None

    def unsupported_grouping(self, spec) -> str | None:
        """Why the template does not serve the spec's kind of weight (one weight, or experts that rows are routed
        to: `grouped`), or None."""
        if bool(spec.experts) == self.grouped:
            return None
        return "a grouped spec (rows routed to experts)" if spec.experts else \
            f"a spec of one weight (the {self.title} template routes rows to experts)"

    def unsupported_epilogue(self, spec) -> str | None:
        """Why the template cannot emit the spec's epilogue and residual add (its output stage) or its prologue
        (norm, activation quantization), or None."""
        if spec.activation_quant not in self.activation_quants:
            return f"activation_quant={spec.activation_quant!r} (its prologue applies {list(self.activation_quants)})"
        if spec.norm not in self.norms:
            return f"norm={spec.norm!r} (its prologue applies {list(self.norms)})"
        if spec.epilogue not in self.epilogues:
            return f"epilogue={spec.epilogue!r} (its output stage emits {list(self.epilogues)})"
        if spec.residual and not self.residual_add:
            return "a residual add in its output stage"
        return None

    @abc.abstractmethod
    def unsupported(self, spec, n: int, k: int, device) -> str | None:
        """Why the template cannot serve `spec` on a [N, K] weight on `device`, or None if it can."""

    @abc.abstractmethod
    def configs(self, spec, n: int, k: int, bucket: tuple[int, int], device, hint) -> list:
        """Every configuration of the template for this kernel that fits `device`, grown from `hint`."""

    @abc.abstractmethod
    def resources(self, spec, k: int, config):
        """What one unit of work of `config` holds (a CPU task's footprint, a CUDA block's resources)."""

    @abc.abstractmethod
    def work(self, spec, n: int, k: int, m: int, config, device) -> Work:
        """What one call with M rows does (see `Work`)."""

    @abc.abstractmethod
    def build(self, spec, n: int, k: int, config, layout: Layout, bucket: tuple[int, int], device):
        """The compiled kernel of `config` for rows M in `bucket` on `device` (callable as kernel(x, weight,
        bias))."""

    def config_from_dict(self, fields: dict):
        """A configuration from its fields (as cache manifests store them)."""
        return self.config_type(**fields)

    def check_config(self, config) -> None:
        """Raise unless `config` is a configuration of this template."""
        if not isinstance(config, self.config_type):
            raise TypeError(f"config must be a {self.config_type.__name__} for template {self.name!r}, got "
                            f"{type(config).__name__}")

    def __repr__(self) -> str:
        return f"<{self.title} template {self.name!r} ({self.target})>"
