"""Deployment latency on the llama.cpp benchmark's Llama (hidden 2048, MLP 5632, 8 layers; benchmarks/llama_cpp.py's
model, made once in --cache-dir): does `bitkern.prepare` leave nothing for the first `generate` to tune, and how long
a fresh process takes to its first token when the kernels are in a read-only system cache.

1. In one process, with an empty user cache: `from_pretrained` with BitkernConfig(dtype) (quantized on load),
   `bitkern.prepare(model, tokens=(1, PROMPT))` (its summary printed), then ten greedy `generate` calls of GENERATED
   tokens after a PROMPT-token prompt; the first against the median of the last nine, in --runs such processes
   (one process's ratio scatters by a few percent).
2. The first such process's cache is then the system cache (`BITKERN_SYSTEM_CACHE_DIR`; trusted: this user owns it and only
   it can write it) of fresh processes with an empty user cache of their own, each timing from its start (the
   interpreter's, by the clock before Python ran) through `import bitkern`, `from_pretrained`, `prepare` (every
   kernel loaded, none built) and the first token of a PROMPT-token prompt.  Medians over --runs processes.

Run: python benchmarks/deploy_latency.py [--dtype int4] [--runs 3] [--cache-dir ~/.cache/bitkern-llamacpp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import header

PROMPT, GENERATED = 8, 16


def _load(model_dir: str, dtype: str):
    import bitkern
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype="bfloat16",
                                                quantization_config=bitkern.BitkernConfig(dtype))


def in_process(model_dir: str, dtype: str) -> dict:
    """Phase 1: prepare, then ten generate calls (seconds each) and the summary."""
    import torch

    import bitkern

    model = _load(model_dir, dtype)
    report = bitkern.prepare(model, tokens=(1, PROMPT), progress=False)
    prompt = torch.randint(3, 32000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    seconds = []
    for _ in range(10):
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=GENERATED, min_new_tokens=GENERATED, do_sample=False)
        seconds.append(time.perf_counter() - start)
    return {"summary": str(report), "built": report.built, "generate_s": seconds}


def first_token(model_dir: str, dtype: str, started: float) -> dict:
    """Phase 2, in a fresh process: seconds from `started` (the parent's clock just before it started this
    process) to each step, and the prepare summary."""
    marks = {"interpreter": time.time() - started}
    import torch

    import bitkern

    marks["import"] = time.time() - started
    model = _load(model_dir, dtype)
    marks["from_pretrained"] = time.time() - started
    report = bitkern.prepare(model, tokens=(1, PROMPT), progress=False)
    marks["prepare"] = time.time() - started
    prompt = torch.randint(3, 32000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    model.generate(prompt, max_new_tokens=1, do_sample=False)
    marks["first token"] = time.time() - started
    return {"marks": marks, "built": report.built, "loaded": report.loaded, "summary": str(report)}


def _child(phase: str, model_dir: str, dtype: str, environment: dict) -> dict:
    started = time.time()
    result = subprocess.run([sys.executable, __file__, "--phase", phase, "--model", model_dir, "--dtype", dtype,
                             "--started", repr(started)], env=environment, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{phase} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "bitkern-llamacpp")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--started", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase == "in-process":
        print(json.dumps(in_process(args.model, args.dtype)))
        return
    if args.phase == "first-token":
        print(json.dumps(first_token(args.model, args.dtype, args.started)))
        return

    sys.path.insert(0, os.path.dirname(__file__))
    from llama_cpp import make_model

    model_dir = str(make_model(args.cache_dir.expanduser() / "model"))
    base = {k: v for k, v in os.environ.items() if not k.startswith("BITKERN_")}
    with tempfile.TemporaryDirectory() as system, tempfile.TemporaryDirectory() as users:
        os.chmod(system, 0o700)
        warm = [_child("in-process", model_dir, args.dtype,
                       {**base, "BITKERN_CACHE_DIR": system if run == 0 else str(Path(users) / f"warm{run}")})
                for run in range(args.runs)]
        firsts = [w["generate_s"][0] for w in warm]
        rests = [statistics.median(w["generate_s"][1:]) for w in warm]
        ratios = [first / rest for first, rest in zip(firsts, rests)]
        runs = []
        for run in range(args.runs):
            user = Path(users) / str(run)
            runs.append(_child("first-token", model_dir, args.dtype,
                               {**base, "BITKERN_SYSTEM_CACHE_DIR": system, "BITKERN_CACHE_DIR": str(user)}))
    import torch

    lines = [header(), "", f"# Deployment latency, {args.dtype}, the llama.cpp benchmark's Llama", "",
             f"{torch.get_num_threads()} threads", "",
             f"In one process after `bitkern.prepare` ({warm[0]['summary']}), {args.runs} processes: first generate "
             f"of {GENERATED} tokens {statistics.median(firsts) * 1e3:.0f} ms, median of the next nine "
             f"{statistics.median(rests) * 1e3:.0f} ms (medians); first / rest per process "
             f"{', '.join(f'{ratio:.2f}' for ratio in ratios)}, median {statistics.median(ratios):.2f}.", "",
             f"A fresh process on that warm system cache (user cache empty), seconds since it started, median of "
             f"{args.runs}:", "", "| step | s |", "|---|---|"]
    for mark in runs[0]["marks"]:
        lines.append(f"| {mark} | {statistics.median(r['marks'][mark] for r in runs):.2f} |")
    lines += ["", f"Kernels built in those processes: {[r['built'] for r in runs]}; loaded: "
                  f"{[r['loaded'] for r in runs]}."]
    text = "\n".join(lines) + "\n"
    print(text)
    (Path(__file__).parent / "results" / "deploy_latency.md").write_text(text)


if __name__ == "__main__":
    main()
