"""Shared benchmark fixtures: the machine's measured DRAM read bandwidth, weight rotation, and a summary
table of every case, printed at the end of the run and written to benchmarks/results/."""

from __future__ import annotations

import os
import shlex
import statistics
import time
from pathlib import Path

import pytest
import torch

from provenance import header


def _rotation_bytes() -> int:
    """Weights rotate through this much memory so that they come from DRAM: at least 1 GiB and three times
    the last-level cache (an LLC that holds a third of a rotation still serves some reads)."""
    from bitkern.tuner import host_cpu

    return max(1 << 30, 3 * host_cpu().llc_bytes)


ROTATION_BYTES = _rotation_bytes()
WARMUP_S = 0.3
RESULTS = Path(__file__).parent / "results"
_rows: list[dict] = []


def rotation(make, bytes_per_copy: int):
    """Enough copies from `make()` to cover ROTATION_BYTES, and a function returning the next one."""
    count = max(2, -(-ROTATION_BYTES // max(1, bytes_per_copy)))
    copies = [make() for _ in range(count)]
    position = [0]

    def next_copy():
        position[0] = (position[0] + 1) % count
        return copies[position[0]]

    return next_copy


def measure(benchmark, call, rounds: tuple[int, int], warmup_rounds: int) -> float:
    """Median seconds per call over enough rounds (within `rounds`) for ~0.5 s, after warm-up calls for
    WARMUP_S (the first compiles) and a one-call estimate.  Right after a kernel is tuned, calls ran up to 2x
    slower for ~0.1 s (a transient seen in probes on this VM, cause not found): three warm-up calls let it into
    the median of the first case measured after tuning."""
    estimate = _warmed_up(call)
    benchmark.pedantic(call, rounds=max(rounds[0], min(rounds[1], int(0.5 / max(estimate, 1e-6)))),
                       warmup_rounds=warmup_rounds)
    return benchmark.stats.stats.median


def _warmed_up(call) -> float:
    """Call `call` for WARMUP_S (at least three times), then once more: that call's seconds, an estimate."""
    start = time.perf_counter()
    calls = 0
    while calls < 3 or time.perf_counter() - start < WARMUP_S:
        call()
        calls += 1
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def recorded(table: str) -> list[dict]:
    """The rows recorded so far for `table`."""
    return [row for row in _rows if row["table"] == table]


class ReportedSeconds(float):
    """The seconds a call took as the process that ran it measured them (`interleaved` counts them, not the wall
    time of asking for the call)."""


def interleaved(calls: dict, rounds: int = 15, round_s: float = 0.03,
                clock=time.perf_counter) -> dict[str, list[float]]:
    """Median seconds per call of each entry, round by round, the entries taking turns within every round.  On
    this shared VM the memory bandwidth drifts by up to 1.5x within a minute: a ratio taken round by round
    (`round_ratio`) compares two entries under the same conditions, where two separate measurements may not.
    clock: what is measured (time.process_time: CPU seconds, which a crowded machine's waits do not inflate).  A
    call that returns `ReportedSeconds` (another process's call, timed where it ran) counts those seconds."""
    repeats = {name: max(2, min(50, int(round_s / max(_warmed_up(call), 1e-6)))) for name, call in calls.items()}
    medians = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            samples = []
            for _ in range(repeats[name]):
                start = clock()
                reported = call()
                elapsed = clock() - start
                samples.append(reported if isinstance(reported, ReportedSeconds) else elapsed)
            medians[name].append(statistics.median(samples))
    return medians


def round_ratio(numerator: list[float], denominator: list[float]) -> float:
    """The median over rounds of numerator / denominator (per-round values from `interleaved`)."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def read_probes() -> tuple[dict, int]:
    """Calls that each read ROTATION_BYTES once from DRAM, and that byte count: torch.sum and a TVM streaming
    reader (vector loads, all threads).  Neither always wins on this VM; the bandwidth is the faster one's."""
    words = ROTATION_BYTES // 4 // 1024 * 1024
    buffer = torch.ones(words, dtype=torch.int32)
    return {"torch.sum": lambda view=buffer.view(torch.float32): view.sum(),
            "tvm stream": _stream_reader(buffer)}, words * 4


def best_read_gbs(probes: dict, nbytes: int, reads: int = 7, clock=time.perf_counter) -> float:
    """DRAM read bandwidth (GB/s) now: the best of `reads` reads of each probe (after one untimed read); with
    clock=time.process_time, GB per CPU second."""
    best = 0.0
    for probe in probes.values():
        probe()
        for _ in range(reads):
            start = clock()
            probe()
            best = max(best, nbytes / (clock() - start) / 1e9)
    return best


@pytest.fixture(scope="session")
def dram_probes() -> tuple[dict, int]:
    return read_probes()


@pytest.fixture(scope="session")
def dram_read_gbs(dram_probes) -> float:
    """The machine's DRAM read bandwidth (GB/s) at the start of the run."""
    return best_read_gbs(*dram_probes)


def _stream_reader(buffer: torch.Tensor):
    """A compiled kernel that reads `buffer` once (64-byte vectors, 4 accumulators), in parallel chunks.  It
    leaves the streams to the hardware prefetchers: in probes, software prefetch made it ~20% slower."""
    import tvm
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    from bitkern.codegen.cpu.emit.tir import load, ramp, splat
    from bitkern.tuner import host_cpu

    chunks = 1024
    per_chunk = buffer.numel() // chunks
    with IRBuilder() as builder:
        with T.prim_func():
            T.func_name("main")
            data = T.arg("data", T.Buffer((chunks, per_chunk), "int32"))
            out = T.arg("out", T.Buffer((chunks, 16), "int32"))
            T.func_attr({"tirx.noalias": True})
            with T.parallel(0, chunks) as c:
                acc = T.alloc_buffer((4, 16), "int32", scope="local")
                for a in range(4):
                    T.buffer_store(acc, splat(0, "int32"), [a, ramp(0)])
                with T.serial(0, per_chunk // 64) as i:
                    for a in range(4):
                        T.buffer_store(acc, load(acc, a, ramp(0)) ^ load(data, c, ramp(i * 64 + a * 16)), [a, ramp(0)])
                total = (load(acc, 0, ramp(0)) ^ load(acc, 1, ramp(0))) ^ (load(acc, 2, ramp(0)) ^ load(acc, 3, ramp(0)))
                T.buffer_store(out, total, [c, ramp(0)])
    function = tvm.compile(tvm.IRModule({"main": builder.get()}), target=host_cpu().tvm_target())["main"]
    view, out = buffer[:chunks * per_chunk].view(chunks, per_chunk), torch.empty(chunks, 16, dtype=torch.int32)
    return lambda: function(view, out)


@pytest.fixture(scope="session")
def record():
    """record(table, row_dict): collect one result row for the summary of `table`."""

    def add(table: str, **row):
        _rows.append({"table": table, **row})

    return add


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    RESULTS.mkdir(exist_ok=True)
    for table in sorted({row["table"] for row in _rows}):
        rows = [row for row in _rows if row["table"] == table]
        columns = [key for key in rows[0] if key != "table"]
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_format(row.get(c)) for c in columns) + " |" for row in rows]
        text = "\n".join(lines)
        terminalreporter.write_line(f"\n{table}\n{text}")
        load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
        command = "python -m pytest " + shlex.join(terminalreporter.config.invocation_params.args)
        (RESULTS / f"{table}.md").write_text(f"{header(command)}\n\n{text}\n\nthreads: {torch.get_num_threads()}, "
                                             f"load average at the end: {load}\n")


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if value < 100 else f"{value:.0f}"
    return "" if value is None else str(value)
