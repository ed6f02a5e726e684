"""bitkern through transformers on a Llama-style model (hidden 2048, MLP 5632, 8 layers, vocabulary 32000,
random weights, a bfloat16 checkpoint of 1.1 GB), each measurement in a fresh process:

- `hf_load`: `from_pretrained` of the float checkpoint (bfloat16), of it quantized on load to int4 (group 128)
  by round-to-nearest and by method="hqq", and of the int4 checkpoint `save_pretrained` wrote: seconds, and the process's memory above what it held
  before loading (sampled every millisecond), at its peak and after loading, against the checkpoint's size:
  anonymous memory (RssAnon, the process's own) and all resident memory (VmRSS, with the pages of the mapped
  checkpoint; transformers maps the files and a float model keeps its weights in the mapped pages), in the
  default environment and with OMP_WAIT_POLICY=PASSIVE.
- `hf_generate`: greedy `generate` of 64 new tokens after a 16-token prompt, bitkern int4 (group 128) vs the
  bfloat16 model, tokens/s (median of 3 runs after a warm-up run, the two models taking turns), in the default
  environment and with OMP_WAIT_POLICY=PASSIVE (torch's OpenMP workers sleep instead of spinning between
  parallel regions, which on a busy machine keeps them from taking the cores bitkern's kernels run on).
Run: python -m pytest benchmarks/bench_hf.py  (tables land in benchmarks/results/).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=512, tie_word_embeddings=False)
NEW_TOKENS, PROMPT_TOKENS, RUNS = 64, 16, 3
QUANTIZATION = {"dtype": "int4", "group_size": 128}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"bfloat16": the float checkpoint, "int4": it quantized and saved by save_pretrained}."""
    folder = tmp_path_factory.mktemp("llama-2048")
    _worker({"task": "make", "float": str(folder / "bfloat16"), "quantized": str(folder / "int4")})
    return {"bfloat16": folder / "bfloat16", "int4": folder / "int4"}


@pytest.mark.parametrize("wait_policy", ["default", "PASSIVE"])
def test_load_memory_and_time(checkpoints, record, wait_policy):
    environment = {} if wait_policy == "default" else {"OMP_WAIT_POLICY": wait_policy}
    checkpoint_bytes = sum(f.stat().st_size for f in checkpoints["bfloat16"].glob("*.safetensors"))
    cases = {"float (bfloat16)": (checkpoints["bfloat16"], None),
             "int4 quantized on load": (checkpoints["bfloat16"], QUANTIZATION),
             "int4 method=\"hqq\" quantized on load": (checkpoints["bfloat16"], {**QUANTIZATION, "method": "hqq"}),
             "int4 pre-quantized": (checkpoints["int4"], None)}
    for name, (path, quantization) in cases.items():
        result = _worker({"task": "load", "path": str(path), "quantization": quantization}, environment)
        record("hf_load", OMP_WAIT_POLICY=wait_policy, load=name, seconds=result["seconds"],
               checkpoint_MiB=checkpoint_bytes / 2**20,
               peak_anon_MiB=result["peak"]["anon"] / 2**20, peak_rss_MiB=result["peak"]["rss"] / 2**20,
               held_anon_MiB=result["held"]["anon"] / 2**20, held_rss_MiB=result["held"]["rss"] / 2**20,
               peak_anon_vs_checkpoint=result["peak"]["anon"] / checkpoint_bytes, load_1min=_load())


@pytest.mark.parametrize("wait_policy", ["default", "PASSIVE"])
def test_generate_tokens_per_second(checkpoints, record, wait_policy):
    environment = {} if wait_policy == "default" else {"OMP_WAIT_POLICY": wait_policy}
    result = _worker({"task": "generate", "float": str(checkpoints["bfloat16"]),
                      "quantized": str(checkpoints["int4"])}, environment)
    rates = {name: NEW_TOKENS / statistics.median(seconds) for name, seconds in result.items()}
    for name, rate in rates.items():
        record("hf_generate", OMP_WAIT_POLICY=wait_policy, model=name, tokens_per_s=rate,
               vs_bfloat16=rate / rates["torch bfloat16"], load_1min=_load())


def _load() -> str:
    with open("/proc/loadavg") as loadavg:
        return loadavg.read().split()[0]


def _worker(request: dict, environment: dict | None = None) -> dict:
    """Run one measurement in a fresh process (this file as a script) and return its result."""
    completed = subprocess.run([sys.executable, __file__, json.dumps(request)], capture_output=True, text=True,
                               env=dict(os.environ, HF_HUB_OFFLINE="1", **(environment or {})), timeout=3600)
    if completed.returncode:
        raise RuntimeError(f"worker {request['task']} failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


# -- the worker ----------------------------------------------------------------------------------------------
def _memory() -> dict:
    """The process's resident memory in bytes: "anon" (RssAnon, its own) and "rss" (VmRSS, with mapped files)."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {"anon": int(fields["RssAnon"].split()[0]) * 1024, "rss": int(fields["VmRSS"].split()[0]) * 1024}


def _peaks(call):
    """(seconds, {"anon", "rss": peak above the start}, {"anon", "rss": held after}) of `call()`, sampled every
    millisecond."""
    start, peak, done = _memory(), _memory(), threading.Event()

    def sample():
        while not done.is_set():
            now = _memory()
            for key in peak:
                peak[key] = max(peak[key], now[key])
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    began = time.perf_counter()
    try:
        result = call()
    finally:
        seconds = time.perf_counter() - began
        done.set()
        sampler.join()
    end = _memory()
    return (result, seconds, {key: max(peak[key], end[key]) - start[key] for key in start},
            {key: end[key] - start[key] for key in start})


def _main(request: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import bitkern

    if request["task"] == "make":
        torch.manual_seed(0)
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**SHAPE, dtype="bfloat16"))
        model = model.to_empty(device="cpu").to(torch.bfloat16)
        for parameter in model.parameters():
            torch.nn.init.normal_(parameter, std=0.02)
        model.save_pretrained(request["float"])
        del model
        quantized = AutoModelForCausalLM.from_pretrained(request["float"],
                                                         quantization_config=bitkern.BitkernConfig(**QUANTIZATION))
        quantized.save_pretrained(request["quantized"])
        return {}
    if request["task"] == "load":
        # (quantization_config=None would erase the saved checkpoint's config: pass it only when there is one)
        options = {} if request["quantization"] is None else {
            "quantization_config": bitkern.BitkernConfig(**request["quantization"])}
        model, seconds, peak, held = _peaks(
            lambda: AutoModelForCausalLM.from_pretrained(request["path"], dtype=torch.bfloat16, **options))
        return {"seconds": seconds, "peak": peak, "held": held}
    models = {"torch bfloat16": AutoModelForCausalLM.from_pretrained(request["float"], dtype=torch.bfloat16).eval(),
              "bitkern int4": AutoModelForCausalLM.from_pretrained(request["quantized"], dtype=torch.bfloat16).eval()}
    prompt = torch.randint(0, SHAPE["vocab_size"], (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    seconds = {name: [] for name in models}
    for round_ in range(RUNS + 1):
        for name, model in models.items():
            began = time.perf_counter()
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            if round_:  # the first round compiles bitkern's kernels
                seconds[name].append(time.perf_counter() - began)
            assert out.shape[1] == PROMPT_TOKENS + NEW_TOKENS
    return seconds


if __name__ == "__main__":
    print(json.dumps(_main(json.loads(sys.argv[1]))))
