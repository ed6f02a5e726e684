"""Fused against unfused bitkern kernels in a Llama: one decoder layer and the whole tiny Llama (random weights,
hidden 2048, MLP 5632, 8 layers, 32 heads, 8 KV heads, bf16, every Linear but lm_head int4 g128: the model of
benchmarks/llama_threads.py), at 1, 16 and 128 tokens, eager and torch.compile'd.

Compiled, the fused model also runs bitkern's Inductor post-grad pass (`bitkern.fusion.FusionPass`: residual
adds and activations after a linear), whose decisions are printed.  For each token count the fused model is `bitkern.fuse(copy, example)` decided at that token count (the cost model
may keep a group unfused: the `explain` tables printed show each decision).  Both models are timed in the same
process, in alternation (per round: unfused, fused without the norm groups, fused), after warm-up; reported:
medians of time per token, the median of per-round ratios unfused/fused, the norm fusion's own share
(`norm_gain`: fused without norms / fused; input_layernorm and post_attention_layernorm folded into the q/k/v and
gate/up kernels' prologue), and bitkern kernel calls per decoder layer (and how many of them normalize x).

Run: python benchmarks/bench_fusion.py [--rounds 7] [--layers 8] [--tokens 1 16 128] [--compiled] [--threads N]
(the first run builds the kernels into the cache; report the load: `uptime`)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

import torch


def tiny_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    import bitkern

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    bitkern.quantize_model(model, "int4", group_size=128, compute_dtype=torch.bfloat16, skip=["lm_head"])
    return model


def layer_call(model, tokens: int):
    """A callable running decoder layer 0 on `tokens` hidden states (rotary embeddings precomputed)."""
    hidden = torch.randn(1, tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(2),
                         dtype=torch.bfloat16)
    positions = torch.arange(tokens)[None]
    embeddings = model.model.rotary_emb(hidden, positions)
    layer = model.model.layers[0]
    return lambda: layer(hidden, position_embeddings=embeddings, position_ids=positions)


def kernel_calls(call) -> str:
    """bitkern op calls in one call of `call` (counted at torch's dispatcher), and those with a norm prologue."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = normed = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += func.namespace == "bitkern"
            Count.normed += func.namespace == "bitkern" and len(args) > 7 and args[7] != "none"
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Count():
        call()
    return f"{Count.calls} ({Count.normed} with a norm)"


def interleaved(calls: dict, rounds: int) -> dict:
    """{name: [seconds per round]}, the calls taking turns each round after two warm-up calls each."""
    times = {name: [] for name in calls}
    with torch.inference_mode():
        for call in calls.values():
            call(), call()
        for _ in range(rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    import bitkern
    from bitkern.fusion import FusionPass, explain

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--compiled", action="store_true", help="also time both models under torch.compile")
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: its own)")
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    unfused = tiny_llama(arguments.layers)
    print(f"load: {os.getloadavg()}, threads: {torch.get_num_threads()}")
    results = []
    for tokens in arguments.tokens:
        ids = torch.randint(0, unfused.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
        fused, without_norms = copy.deepcopy(unfused), copy.deepcopy(unfused)
        print(f"\n## {tokens} tokens: explain (decisions at this size)\n{explain(fused, ids)}")
        bitkern.fuse(fused, ids)
        bitkern.fuse(without_norms, ids, patterns=("qkv", "swiglu", "act"))
        variants = {"unfused": unfused, "fused_without_norms": without_norms, "fused": fused}
        layers = {name: layer_call(model, tokens) for name, model in variants.items()}
        wholes = {name: (lambda model=model: model(ids, use_cache=False)) for name, model in variants.items()}
        calls = {name: kernel_calls(call) for name, call in layers.items()}
        runs = [("layer", "eager", layers), ("model", "eager", wholes)]
        if arguments.compiled:  # the fused model compiles with bitkern's post-grad pass, the unfused without
            fusion_pass = FusionPass()
            options = {"unfused": {}, "fused_without_norms": {"post_grad_custom_post_pass": [fusion_pass]},
                       "fused": {"post_grad_custom_post_pass": [fusion_pass]}}
            runs += [("layer", "compiled", {n: torch.compile(c, options=options[n]) for n, c in layers.items()}),
                     ("model", "compiled", {n: torch.compile(c, options=options[n]) for n, c in wholes.items()})]
        for scope, mode, timed in runs:
            times = interleaved(timed, arguments.rounds)
            ratios = [u / f for u, f in zip(times["unfused"], times["fused"])]
            norm_ratios = [w / f for w, f in zip(times["fused_without_norms"], times["fused"])]
            row = {"scope": scope, "mode": mode, "tokens": tokens,
                   **{f"{name}_ms_per_token": 1e3 * statistics.median(times[name]) / tokens for name in variants},
                   "speedup": statistics.median(ratios), "norm_gain": statistics.median(norm_ratios),
                   "kernel_calls_per_layer": calls}
            results.append(row)
            print(json.dumps(row), flush=True)
            if mode == "compiled":
                print(f"post-grad pass decisions (pattern, rows, modeled gain, fused): {fusion_pass.decisions}")
                fusion_pass.decisions.clear()
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
