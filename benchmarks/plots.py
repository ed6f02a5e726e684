"""The docs' figures, drawn from the benchmarks' results files: one function per figure, called by the benchmark
that writes its data (`render(results_file)` after writing it), and `python benchmarks/plots.py` re-renders every
figure from the current results files without rerunning any hardware.  PNGs go to docs/images/.

The GPU kit's benchmark runs where only torch is installed, so its figure is drawn here when its results come back.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).resolve().parent / "results"
IMAGES = Path(__file__).resolve().parent.parent / "docs" / "images"
GPU_PEERS = {"cublas_fp16": "cuBLAS fp16", "cublas_bf16": "cuBLAS bf16", "tinygemm": "torch int4 (tinygemm)",
             "gemlite": "gemlite A16W4"}
# llama.cpp results file -> its panel's label (the machine and the activations bitkern ran with)
LLAMA_CPP_PANELS = {"llama_cpp_x86-64-v3.md": "Zen 5 held to x86-64-v3 (AVX2)",
                    "llama_cpp_x86-64-v3_zen4.md": "Zen 4 held to x86-64-v3 (AVX2, int8 activations)",
                    "llama_cpp_zen4.md": "Zen 4 (AVX-512, bf16 activations)",
                    "llama_cpp_moe.md": "Zen 4, mixture of experts (64 of 768, top-8)",
                    "llama_cpp_decode_attention.md": "Xeon Sapphire Rapids (int8 activations)",
                    "llama_cpp_xeon_bf16_activations.md": "Xeon Sapphire Rapids (AMX, bf16 activations)"}
LLAMA_CPP_TESTS = ("pp512 t/s", "tg64 t/s")
METHOD_COLORS = {"rtn": "#9e9e9e", "hqq": "#4c72b0", "gptq": "#dd8452"}


def read_table(path: Path) -> list[dict[str, str]]:
    """The rows of the first markdown table in `path`, as {column: cell}."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return [dict(zip(table[0], cells)) for cells in table[2:]]


def _save(figure, path: Path) -> Path:
    """Write `figure` as a small PNG (no timestamp in its metadata, so an unchanged figure is the same file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80, metadata={"Software": None}, pil_kwargs={"optimize": True})
    import matplotlib.pyplot as plt

    plt.close(figure)
    return path


def gpu_speedup(report: dict, path: Path) -> Path:
    """bitkern int4's speed-up over each peer by M (median over the layer shapes, band from the slowest to the
    fastest shape), from the GPU kit's bench.json."""
    import matplotlib.pyplot as plt

    rows = [row for row in report["rows"] if row["type"] == "int4"]
    m_values = sorted({row["m"] for row in rows})
    shapes = len({(row["n"], row["k"]) for row in rows})
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for peer, label in GPU_PEERS.items():
        by_m = [[row[f"speedup_vs_{peer}"] for row in rows if row["m"] == m and f"speedup_vs_{peer}" in row]
                for m in m_values]
        present = [(m, values) for m, values in zip(m_values, by_m) if values]
        if not present:
            continue
        ms = [m for m, _ in present]
        line, = axes.plot(ms, [statistics.median(v) for _, v in present], marker="o", label=label,
                          linestyle=":" if peer == "cublas_bf16" else "-")
        axes.fill_between(ms, [min(v) for _, v in present], [max(v) for _, v in present], color=line.get_color(),
                          alpha=0.15)
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="parity (1x)")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xticks(m_values, [str(m) for m in m_values])
    axes.set_xlabel("M, rows of activations (log scale)")
    axes.set_ylabel("speed-up: peer time / bitkern time (x, log scale)")
    axes.set_title(f"bitkern int4 g128 on {report['device']}: speed-up over peers by M\n(median of {shapes} "
                   f"Llama-3 layer shapes, band: slowest to fastest shape; CUDA-graph replays, L2 flushed)",
                   fontsize=10)
    axes.legend(fontsize=8)
    axes.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    return _save(figure, path)


def llama_cpp(panels: dict[str, list[dict[str, str]]], path: Path) -> Path:
    """Prompt (pp512) and generation (tg64) tokens/s of every system, one row of panels per machine, from
    benchmarks/llama_cpp.py's results tables (bitkern, llama.cpp and, where a run has it, torch bf16)."""
    import matplotlib.pyplot as plt

    figure, grid = plt.subplots(len(panels), len(LLAMA_CPP_TESTS), figsize=(9, 1.9 * len(panels) + 0.9),
                                sharey="row", squeeze=False)
    families = {"bitkern": "#4c72b0", "llama.cpp": "#dd8452", "torch bf16": "#55a868"}
    for (label, rows), axes_row in zip(panels.items(), grid):
        systems = [row["system"] for row in rows]
        colors = [families[_family(system)] for system in systems]
        for axes, test in zip(axes_row, LLAMA_CPP_TESTS):
            axes.barh(range(len(rows)), [float(row[test]) for row in rows], color=colors)
            axes.set_title(f"{label}: {test.split()[0]}", fontsize=8)
            axes.set_xlabel(f"{test.split()[0]}, tokens/s", fontsize=7)
            axes.tick_params(labelsize=6)
            axes.grid(True, axis="x", alpha=0.3)
        axes_row[0].set_yticks(range(len(rows)), [("llama.cpp " if _family(s) == "llama.cpp" else "") + s
                                                  for s in systems])
        axes_row[0].invert_yaxis()
    present = list(dict.fromkeys(_family(row["system"]) for rows in panels.values() for row in rows))
    handles = [plt.Rectangle((0, 0), 1, 1, color=families[family]) for family in present]
    figure.legend(handles, present, loc="lower center", ncol=len(present), fontsize=8)
    figure.suptitle("Random-weight Llama (hidden 2048, 8 layers; the mixture of experts: Mixtral-style, 64 experts "
                    "of 768, top-8),\n2 threads on 2-core VMs: prompt (pp512) and generation (tg64) tokens/s",
                    fontsize=9)
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    return _save(figure, path)


def _family(system: str) -> str:
    if system.startswith("bitkern"):
        return "bitkern"
    return "torch bf16" if system.startswith("torch") else "llama.cpp"


def accuracy(rows: list[dict[str, str]], path: Path) -> Path:
    """Worst cosine of the sentence embeddings to float by weight type (and group) and method, from
    benchmarks/accuracy.py's table."""
    import matplotlib.pyplot as plt

    types = list(dict.fromkeys(f"{row['type']} g{row['group']}" for row in rows))
    methods = list(dict.fromkeys(row["method"] for row in rows))
    width = 0.8 / len(methods)
    figure, axes = plt.subplots(figsize=(8, 4.2))
    for offset, method in enumerate(methods):
        values = {f"{row['type']} g{row['group']}": float(row["min cosine"]) for row in rows if row["method"] == method}
        xs = [i + (offset - (len(methods) - 1) / 2) * width for i, name in enumerate(types) if name in values]
        heights = [values[name] for name in types if name in values]
        bars = axes.bar(xs, heights, width, label=method, color=METHOD_COLORS.get(method))
        axes.bar_label(bars, [f"{h:.3f}" for h in heights], fontsize=6, padding=1)
    lowest = min(float(row["min cosine"]) for row in rows)
    axes.set_ylim(max(0.0, lowest - 0.05), 1.005)
    axes.set_xticks(range(len(types)), types)
    axes.set_xlabel("weight type and group size")
    axes.set_ylabel("worst cosine to float (12 sentences)")
    axes.set_title("all-MiniLM-L6-v2, every linear layer quantized: worst cosine of the sentence embeddings to "
                   "float", fontsize=10)
    axes.legend(title="method", fontsize=8)
    axes.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    return _save(figure, path)


@dataclass(frozen=True)
class Figure:
    """One docs image: its file name, the results files (relative to benchmarks/results) it is drawn from, and how."""
    image: str
    sources: tuple[str, ...]
    draw: Callable[[Path, tuple[Path, ...]], Path]


FIGURES = (
    Figure("cuda_h100_speedup.png", ("gpu_kit_h100/bench.json",),
           lambda path, files: gpu_speedup(json.loads(files[0].read_text()), path)),
    Figure("llama_cpp_cpus.png", tuple(LLAMA_CPP_PANELS),
           lambda path, files: llama_cpp({LLAMA_CPP_PANELS[f.name]: read_table(f) for f in files}, path)),
    Figure("accuracy_minilm.png", ("accuracy_minilm.md",), lambda path, files: accuracy(read_table(files[0]), path)),
)


def render(results_file: Path | None = None, results: Path = RESULTS, images: Path = IMAGES) -> list[Path]:
    """Draw every figure drawn from `results_file` (every figure when None) from the results files in `results`,
    into `images`; the paths written."""
    chosen = [figure for figure in FIGURES if results_file is None
              or Path(results_file).resolve() in {(results / source).resolve() for source in figure.sources}]
    if results_file is not None and not chosen:
        print(f"plots: no figure is drawn from {results_file}", file=sys.stderr)
    return [figure.draw(images / figure.image, tuple(results / source for source in figure.sources))
            for figure in chosen]


if __name__ == "__main__":
    import matplotlib

    matplotlib.use("Agg")
    for written in render():
        print(f"{written.relative_to(IMAGES.parent.parent)}: {written.stat().st_size // 1024} KB")
