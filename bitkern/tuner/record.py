"""The record of one tuning decision: every candidate considered, its modeled cost, its measured time."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Trial:
    template: str
    config: object
    modeled_s: float
    measured_s: float | None = None
    build_s: float | None = None
    failed: str | None = None  # why it did not build, where it was tried and failed


@dataclass
class TuningRecord:
    """What the tuner saw and chose for one (spec, N, K, M bucket, device)."""

    spec: object
    n: int
    k: int
    bucket: tuple[int, int]
    tuned_m: int
    device: str
    hint: object
    trials: list[Trial] = field(default_factory=list)
    chosen: int = 0
    profiled: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def choice(self) -> Trial:
        return self.trials[self.chosen]

    def summary(self) -> str:
        """One line: what was tuned, what won, how."""
        trial = self.choice
        how = f"measured {trial.measured_s * 1e3:.3f} ms" if trial.measured_s is not None else "modeled (no device)"
        return (f"{self.spec.weight_dtype} {self.spec.activation_dtype} N={self.n} K={self.k} "
                f"M={self.bucket[0]}..{self.bucket[1]}: {trial.template} {trial.config} ({how}; "
                f"{len(self.trials)} candidates, {sum(t.measured_s is not None for t in self.trials)} built, "
                f"{self.seconds:.2f} s)")

    def __str__(self) -> str:
        lines = [self.summary(), f"device {self.device}; hint m{self.hint.m} n{self.hint.n} k{self.hint.k} "
                                 f"({'; '.join(self.hint.sources)})"]
        lines += [f"note: {note}" for note in self.notes]
        ranked = sorted(range(len(self.trials)), key=lambda i: self.trials[i].modeled_s)
        lines.append(f"{'rank':>4} {'modeled ms':>10} {'measured ms':>11} {'build s':>7}  template config")
        for rank, i in enumerate(ranked):
            trial = self.trials[i]
            if trial.measured_s is None and rank >= 12 and i != self.chosen:
                continue
            measured = f"{trial.measured_s * 1e3:11.3f}" if trial.measured_s is not None else f"{'-':>11}"
            built = f"{trial.build_s:7.2f}" if trial.build_s is not None else f"{'-':>7}"
            mark = " <= chosen" if i == self.chosen else f" (failed to build: {trial.failed})" if trial.failed else ""
            lines.append(f"{rank:>4} {trial.modeled_s * 1e3:10.3f} {measured} {built}  {trial.template} "
                         f"{trial.config}{mark}")
        hidden = sum(1 for r, i in enumerate(ranked) if r >= 12 and self.trials[i].measured_s is None and i != self.chosen)
        if hidden:
            lines.append(f"     ... {hidden} more candidates, modeled only")
        return "\n".join(lines)
