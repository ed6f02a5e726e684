"""vLLM offline throughput on this CPU: a Llama-style model (hidden 2048, MLP 5632, 8 layers, 32 heads / 4 KV
heads, random weights, bfloat16) served by vLLM as it is and with `quantization="bitkern"` (int4, group 128).

Output tokens per second with 1 and 8 requests in flight (each request: a 32-token prompt, 64 generated tokens,
greedy, EOS ignored), in vLLM's default (compiled) mode.  Every engine runs in a fresh process, once with the
default environment and once with OMP_WAIT_POLICY=PASSIVE (torch's OpenMP workers sleep instead of spinning
between ops, so they do not take the cores from bitkern's kernels); the engines take turns for ROUNDS rounds
(`--rounds N`) and each figure is the median over rounds, each ratio the median of its per-round ratios.

`--fusion [auto|on]` compares bitkern int4 with its fusions off and on instead (BITKERN_VLLM_FUSION=off against
auto, the default: what the cost model fuses; or against on: every match, the SwiGLU epilogue here), default
environment only.

Run with the python of a vLLM environment that has bitkern installed (docs/vllm.md, "Install"):
    python benchmarks/vllm_throughput.py [--rounds N]            (table: benchmarks/results/vllm_throughput.md)
    python benchmarks/vllm_throughput.py --fusion [auto|on] [--rounds N]
                                                  (benchmarks/results/vllm_throughput_fusion_{auto,on}.md)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import header

RESULTS = Path(__file__).parent / "results"
INT4 = {"dtype": "int4", "group_size": 128}
# engine name -> (bitkern settings, or {} for vLLM's own bf16 model; environment variables)
MODELS = {"vLLM bf16": ({}, {}), "bitkern int4": (INT4, {})}
ENVIRONMENTS = {"default": {}, "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}}
CONCURRENCY = (1, 8)
PROMPT_TOKENS, OUTPUT_TOKENS, REPEATS, ROUNDS = 32, 64, 3, 2


def make_model(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu").to(torch.bfloat16)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    model.save_pretrained(path)


def serve(model: str, settings: dict) -> dict:
    """(in a fresh process) Start the engine, warm it up, and time each concurrency REPEATS times: tokens/s."""
    from vllm import LLM, SamplingParams

    options = {} if not settings else {
        "quantization": "bitkern", "hf_overrides": {"quantization_config_dict_json": json.dumps(settings)}}
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, max_num_seqs=8,
              kv_cache_memory_bytes=1 << 30, seed=0, **options)
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": [(97 * i + 13 * j) % 32000 for j in range(PROMPT_TOKENS)]} for i in range(8)]
    for concurrency in CONCURRENCY:  # warm-up: every kernel this run needs is built and loaded
        llm.generate(prompts[:concurrency], params, use_tqdm=False)
    rates = {}
    for concurrency in CONCURRENCY:
        samples = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            outputs = llm.generate(prompts[:concurrency], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            samples.append(sum(len(output.outputs[0].token_ids) for output in outputs) / seconds)
        rates[concurrency] = statistics.median(samples)
    return rates


def measure(model_dir: Path, rounds: int, models: dict, environments: dict) -> dict:
    """{(environment, model): [{concurrency: tokens/s} per round]}, the engines taking turns."""
    runs = {(env, name): [] for env in environments for name in models}
    for round_ in range(rounds):
        for env, variables in environments.items():
            for name, (settings, own_variables) in models.items():
                with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
                    subprocess.run([sys.executable, __file__, "serve", str(model_dir), json.dumps(settings),
                                    result.name], env=dict(os.environ, **variables, **own_variables), check=True)
                    rates = {int(k): v for k, v in json.load(open(result.name)).items()}
                runs[env, name].append(rates)
                print(f"round {round_}: {env:24s} {name:14s} " +
                      "  ".join(f"{c} in flight: {r:7.2f} tok/s" for c, r in rates.items()), flush=True)
    return runs


def table(runs: dict, models: dict, environments: dict) -> str:
    base, other = models
    lines = [f"| environment | requests in flight | {base} (tok/s) | {other} (tok/s) | ratio |", "|---|---|---|---|---|"]
    for env in environments:
        for concurrency in CONCURRENCY:
            first = [run[concurrency] for run in runs[env, base]]
            second = [run[concurrency] for run in runs[env, other]]
            ratio = statistics.median(b / a for a, b in zip(first, second))
            lines.append(f"| {env} | {concurrency} | {statistics.median(first):.2f} | "
                         f"{statistics.median(second):.2f} | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        model, settings, result = sys.argv[2:5]
        Path(result).write_text(json.dumps(serve(model, json.loads(settings))))
        return
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else ROUNDS
    fusion = None
    if "--fusion" in sys.argv:
        following = sys.argv[sys.argv.index("--fusion") + 1:]
        fusion = following[0] if following and following[0] in ("auto", "on") else "auto"
    models, environments = (MODELS, ENVIRONMENTS) if fusion is None else ({
        "int4 fusion off": (INT4, {"BITKERN_VLLM_FUSION": "off"}),
        f"int4 fusion {fusion}": (INT4, {"BITKERN_VLLM_FUSION": fusion})}, {"default": {}})
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        make_model(Path(folder))
        runs = measure(Path(folder), rounds, models, environments)
    text = (f"{header()}\n\n"
            f"vLLM offline throughput (benchmarks/vllm_throughput.py{f' --fusion {fusion}' if fusion else ''}, {rounds} rounds), "
            f"{os.cpu_count()} cores, load average at the start {load:.1f}, at the end {os.getloadavg()[0]:.1f}\n\n"
            f"{table(runs, models, environments)}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / (f"vllm_throughput_fusion_{fusion}.md" if fusion else "vllm_throughput.md")).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
