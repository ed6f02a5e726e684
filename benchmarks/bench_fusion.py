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


def glue_share(layer: torch.nn.Module, call, calls: int = 20) -> dict:
    """Share of the decoder layer's time spent in the torch ops of its norms, activation (and gating multiply) and
    residual adds, by torch.profiler over `calls` calls: each module's forward runs inside a record_function
    naming its role, and every outermost aten op is charged to the role of the module it runs in (ops directly
    in the layer's forward are its residual adds, those directly in the MLP's its gating multiply)."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    def role(module) -> str:
        name = type(module).__name__
        if name.endswith(("RMSNorm", "LayerNorm", "FoldedNorm")):
            return "norm"
        if module is layer:
            return "residual"
        if name.endswith(("MLP", "Activation")) or isinstance(module, (torch.nn.SiLU, torch.nn.GELU, torch.nn.ReLU)):
            return "activation"
        return "other"

    ranges, handles = [], []
    for module in layer.modules():
        label = f"role:{role(module)}"
        handles.append(module.register_forward_pre_hook(
            lambda m, a, label=label: ranges.append(record_function(label).__enter__())))
        handles.append(module.register_forward_hook(lambda m, a, y: ranges.pop().__exit__(None, None, None)))
    try:
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as trace:
            for _ in range(calls):
                call()
    finally:
        for handle in handles:
            handle.remove()
    spent = {"norm": 0.0, "activation": 0.0, "residual": 0.0, "other": 0.0}
    total = 0.0
    for event in trace.events():
        if event.name == "role:residual" and not _inside(event, "role:"):
            total += event.cpu_time_total
        if event.name.startswith("aten::") and not _inside(event, "aten::"):
            owner = _inside(event, "role:")
            if owner:
                spent[owner.name.removeprefix("role:")] += event.cpu_time_total
    return {name: round(value / total, 4) for name, value in spent.items() if name != "other"}


def _inside(event, prefix: str):
    """The nearest enclosing profiler event whose name starts with `prefix` (None: there is none)."""
    parent = event.cpu_parent
    while parent is not None and not parent.name.startswith(prefix):
        parent = parent.cpu_parent
    return parent


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
        shares = {name: glue_share(model.model.layers[0], layers[name]) for name, model in variants.items()}
        runs = [("layer", "eager", layers), ("model", "eager", wholes)]
        if arguments.compiled:  # the fused model compiles with bitkern's post-grad pass, the unfused without
            torch._dynamo.reset()  # three compiles per token count share code objects: dynamo's recompile limit (8)
            fusion_pass = FusionPass()
            # no FX graph cache: a graph cached by an earlier run would skip the pass and its printed decisions
            uncached = {"fx_graph_cache": False}
            with_pass = {**uncached, "post_grad_custom_post_pass": [fusion_pass]}
            options = {"unfused": uncached, "fused_without_norms": with_pass, "fused": with_pass}
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
            if scope == "layer" and mode == "eager":
                row["norm_activation_residual_share"] = shares
            results.append(row)
            print(json.dumps(row), flush=True)
            if mode == "compiled":
                print(f"post-grad pass decisions (pattern, rows, modeled gain, fused): {fusion_pass.decisions}")
                fusion_pass.decisions.clear()
    print(f"load: {os.getloadavg()}")


if __name__ == "__main__":
    main()
