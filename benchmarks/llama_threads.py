"""bitkern layers inside a real model with nothing set in the environment: a Hugging Face LlamaForCausalLM
(random weights, hidden 2048, MLP 5632, 8 layers, 32 heads, 8 KV heads) with every Linear but lm_head
quantized by bitkern, against the same model in bf16 torch.

Every model runs in a process of its own, started with the default environment (no OMP_/GOMP_/KMP_/TVM_
variables) or with OMP_WAIT_POLICY=PASSIVE.  The processes prepare their kernels first (tuned, built or
loaded: never timed), then take turns: per round each one times 16 decode steps (1 token, KV cache of 128
tokens) and one 128-token prompt, while the others wait idle.  Reported: medians over rounds, and ratios
taken per round (same round, same machine state).  The share of a decoder layer's time spent outside
bitkern's kernels at 1 token is timed with module hooks (default environment).

Run: python benchmarks/llama_threads.py [--rounds 9] [--layers 8]   (on a quiet machine; first run tunes
kernels into the cache, ~minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from provenance import header

RESULTS = Path(__file__).parent / "results"
MODELS = {  # name -> bitkern quantization (None: the bf16 model; "import": bf16, with bitkern imported)
    "bf16": None, "bf16 + import bitkern": "import",
    "int4 g128": ("int4", 128), "nf4 g64": ("nf4", 64), "int8 g128": ("int8", 128),
}
ENVIRONMENTS = ("default", "OMP_WAIT_POLICY=PASSIVE")
PROMPT, STEPS = 128, 16


# -- worker: one model in one process --------------------------------------------------------------------
def worker(model_name: str, layers: int) -> None:
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    quantization = MODELS[model_name]
    if quantization is not None:
        import bitkern
        import bitkern.nn.storage
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    if isinstance(quantization, tuple):
        dtype, group = quantization
        bitkern.quantize_model(model, dtype, group_size=group, compute_dtype=torch.bfloat16, skip=["lm_head"])
    prompt = torch.randint(0, config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    token = prompt[:, -1:]
    with torch.inference_mode():
        cache = DynamicCache()
        model(prompt, past_key_values=cache, use_cache=True)  # prepares the kernels of both sizes
        model(token, past_key_values=cache, use_cache=True)

        def decode() -> float:
            if cache.get_seq_length() > PROMPT:
                cache.crop(PROMPT - cache.get_seq_length())  # a negative count: tokens to drop from the end
            times = []
            for _ in range(STEPS):
                start = time.perf_counter()
                model(token, past_key_values=cache, use_cache=True)
                times.append(time.perf_counter() - start)
            return statistics.median(times)

        def prefill() -> float:
            start = time.perf_counter()
            model(prompt, use_cache=False)
            return time.perf_counter() - start

        linears = (torch.nn.Linear,) if quantization is None else (torch.nn.Linear, bitkern.nn.storage.QuantizedModule)
        commands = {"decode": decode, "prefill": prefill, "share": lambda: outside_share(model, decode, linears)}
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            print(json.dumps({"seconds": commands[line.strip()]()}), flush=True)


def outside_share(model, decode, linears: tuple) -> float:
    """1 - (time in the layers' Linear modules) / (time in the decoder layers), over one decode() call."""
    spent = {"layer": 0.0, "linear": 0.0}
    handles = []
    for layer in model.model.layers:
        for kind, modules in (("layer", [layer]), ("linear", [m for m in layer.modules() if isinstance(m, linears)])):
            for module in modules:
                handles.append(module.register_forward_pre_hook(lambda m, a: setattr(m, "_start", time.perf_counter())))
                handles.append(module.register_forward_hook(
                    lambda m, a, y, kind=kind: spent.__setitem__(kind, spent[kind] + time.perf_counter() - m._start)))
    try:
        decode()
    finally:
        for handle in handles:
            handle.remove()
    return 1 - spent["linear"] / spent["layer"]


# -- driver ----------------------------------------------------------------------------------------------
def _environment(name: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_", "TVM_"))}
    if name != "default":
        key, value = name.split("=")
        clean[key] = value
    return clean


class Worker:
    def __init__(self, model: str, environment: str, layers: int):
        self.process = subprocess.Popen([sys.executable, __file__, "--worker", model, "--layers", str(layers)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env=_environment(environment))
        if not json.loads(self.process.stdout.readline()).get("ready"):
            raise RuntimeError(f"worker {model} / {environment} did not start")

    def ask(self, command: str) -> float:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.layers)
    workers = {}
    for model in MODELS:
        for environment in ENVIRONMENTS:
            print(f"starting {model} / {environment} ...", file=sys.stderr, flush=True)
            workers[model, environment] = Worker(model, environment, args.layers)
    samples = {(key, kind): [] for key in workers for kind in ("decode", "prefill")}
    for round_ in range(args.rounds):
        for kind in ("decode", "prefill"):
            for key, process in workers.items():
                samples[key, kind].append(process.ask(kind))
        print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
    shares = {model: statistics.median(workers[model, "default"].ask("share") for _ in range(5))
              for model in MODELS if MODELS[model] != "import"}
    for process in workers.values():
        process.close()
    text = _table(samples, shares, args)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "llama_threads.md").write_text(f"{header()}\n\n{text}\n")


def _ratio(samples, a, b) -> float:
    """Median over rounds of a's time / b's time in the same round."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b]))


def _table(samples, shares, args) -> str:
    passive = ENVIRONMENTS[1]
    lines = [f"LlamaForCausalLM, hidden 2048, MLP 5632, {args.layers} layers, 32/8 heads, vocab 32000, bf16 "
             f"activations; decode: 1 token with {PROMPT} cached, median of {STEPS} steps; prompt: {PROMPT} tokens; "
             f"medians over {args.rounds} interleaved rounds; {os.cpu_count()} CPUs, torch threads: default",
             "", "| model | env | decode ms | prompt ms | default / passive (decode, prompt) | speed-up over bf16 "
             "(decode, prompt) | layer time outside the Linears at 1 token |", "|---|---|---|---|---|---|---|"]
    for model in MODELS:
        for environment in ENVIRONMENTS:
            key = (model, environment)
            decode, prefill = (statistics.median(samples[key, kind]) * 1e3 for kind in ("decode", "prefill"))
            versus_passive = "" if environment == passive else ", ".join(
                f"{_ratio(samples, (key, kind), ((model, passive), kind)):.2f}" for kind in ("decode", "prefill"))
            speedup = ", ".join(f"{_ratio(samples, (('bf16', environment), kind), (key, kind)):.2f}"
                                for kind in ("decode", "prefill"))
            share = f"{shares[model]:.0%}" if environment == "default" and model in shares else ""
            lines.append(f"| {model} | {environment} | {decode:.2f} | {prefill:.1f} | {versus_passive} | {speedup} | "
                         f"{share} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
