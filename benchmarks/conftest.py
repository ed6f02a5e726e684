"""Shared benchmark fixtures: the machine's measured DRAM read bandwidth, weight rotation, and a summary
table of every case, printed at the end of the run and written to benchmarks/results/."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

ROTATION_BYTES = 1 << 30  # weights rotate through at least this much memory, so they come from DRAM
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


def recorded(table: str) -> list[dict]:
    """The rows recorded so far for `table`."""
    return [row for row in _rows if row["table"] == table]


@pytest.fixture(scope="session")
def dram_read_gbs() -> float:
    """Best of several streaming reads of a 1 GiB buffer with all threads (GB/s)."""
    buffer = torch.ones(ROTATION_BYTES // 4, dtype=torch.float32)
    buffer.sum()
    best = 0.0
    for _ in range(7):
        start = time.perf_counter()
        buffer.sum()
        best = max(best, buffer.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return best


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
        (RESULTS / f"{table}.md").write_text(f"{text}\n\nthreads: {torch.get_num_threads()}, "
                                             f"TVM_NUM_THREADS={os.environ.get('TVM_NUM_THREADS')}\n")


def _format(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if value < 100 else f"{value:.0f}"
    return "" if value is None else str(value)
