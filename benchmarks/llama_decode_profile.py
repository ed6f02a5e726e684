"""Where the time of one decode step (1 token, KV cache) of the Llama model of benchmarks/llama_cpp.py goes, with
bitkern's layers, through `model.generate`: the diagnosis behind "generation at llama.cpp speed" (issue 24).

Sections (each printed as a table; all in one process, default environment, medians; the load is printed):
1. steps: ms per decode step of greedy `generate` (stopping-criteria clock), of a bare loop of forwards on a
   DynamicCache (the same work without generate's), with a static cache (bitkern's attention, as the benchmark's
   models; and with transformers' "sdpa" instead), and with torch.compile of the forward on the static cache
   (--compile; compile time printed), once with "sdpa" and once with bitkern's attention ("bitkern",
   `bitkern.integration.hf.use_grouped_attention`: its decode-attention kernel).
2. modules (2 and 3 decode as benchmarks/llama_cpp.py's generate does: GENERATE_OPTIONS, a static cache): the
   step split by forward hooks into self times per module kind (bitkern Linears, lm_head, attention
   core = rope + cache update + SDPA + reshapes, RMSNorm, SwiGLU elementwise, residual adds, model glue, generate's
   own work), and the hooks' own cost (steps with and without hooks).
3. ops: torch.profiler over decode steps: ops called from Python per step (top-level aten/bitkern ops), by name.
4. call costs in isolation: µs of one small torch op from Python, and a bitkern Linear at M=1 on a hot, tiny
   weight peeled layer by layer (module -> custom op -> spec -> kernel object -> compiled function).
5. kernels alone: each layer shape and the lm_head at M=1 with weights rotating through DRAM, against their bytes:
   GB/s and fraction of the DRAM read bandwidth measured in the same run (conftest's streaming probes).
6. glue: generate steps with the kernels and with every kernel call returning zeros (interleaved), so the glue
   (transformers, torch ops, bitkern's dispatch) and the kernels' share are measured, not inferred from hooks.

Run: python benchmarks/llama_decode_profile.py [--dtype "bitkern int4 g128"] [--steps 32] [--rounds 5] [--compile]
[--prompt 8] (the context a step attends over: prompt + steps)
[--cpu-time] [--unfused] (the model is the one benchmarks/llama_cpp.py saves, made here when missing, and loaded as
its benchmark does: quantized, then `bitkern.fuse`d unless --unfused)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from transformers import DynamicCache, StaticCache

from conftest import interleaved, read_probes, rotation
from llama_cpp import BITKERN, CONFIG, GENERATE_OPTIONS, generation_steps, load_model, make_model

# bitkern.fuse's modules whose self time is a fused kernel call or its slicing (counted with the Linears)
FUSED_LINEARS = ("EpilogueLinear", "SharedInputLinears", "StackedOutput")
CLOCK = time.perf_counter  # --cpu-time: time.process_time at 1 thread


def section(title: str, header: list[str], rows: list) -> None:
    print(f"\n## {title}\n\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(f"{c:.3f}" if isinstance(c, float) else str(c) for c in row) + " |")


def forward_steps(model, prompt, steps: int, cache) -> list[float]:
    """Seconds of each of `steps` bare decode forwards (argmax of the last logits fed back), after the prompt."""
    logits = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    times = []
    for step in range(steps):
        token = logits[:, -1:].argmax(-1)
        start = CLOCK()
        position = torch.tensor([prompt.shape[1] + step])
        logits = model(token, past_key_values=cache, use_cache=True, logits_to_keep=1, cache_position=position).logits
        times.append(CLOCK() - start)
    return times


def _compiled_generate(model, forward, switch, prompt, steps: int) -> list[float]:
    """generation_steps with `forward` (compiled) as the model's forward and its attention switched by `switch`."""
    eager, attention = model.forward, model.config._attn_implementation
    switch()
    model.forward = forward
    try:
        return generation_steps(model, prompt, steps + 1, clock=CLOCK, cache_implementation="static")
    finally:
        model.forward = eager
        model.set_attn_implementation(attention)


def _with_attention(model, attention: str, run):
    """run() with the model's attention implementation switched to `attention`, then switched back."""
    own = model.config._attn_implementation
    model.set_attn_implementation(attention)
    try:
        return run()
    finally:
        model.set_attn_implementation(own)


def step_table(model, prompt, steps: int, rounds: int, compile_forward: bool) -> dict[str, float]:
    """Median ms per decode step of each way of decoding, interleaved over rounds."""
    length = prompt.shape[1] + steps + 1
    ways = {"generate, DynamicCache": lambda: generation_steps(model, prompt, steps + 1, clock=CLOCK),
            "bare forwards, DynamicCache": lambda: forward_steps(model, prompt, steps,
                                                                 DynamicCache(config=model.config)),
            "generate, static cache": lambda: generation_steps(model, prompt, steps + 1, clock=CLOCK,
                                                               cache_implementation="static"),
            "bare forwards, static cache": lambda: forward_steps(
                model, prompt, steps, StaticCache(config=model.config, max_cache_len=length)),
            "generate, static cache, attention 'sdpa' (transformers' own)": lambda: _with_attention(
                model, "sdpa", lambda: generation_steps(model, prompt, steps + 1, clock=CLOCK,
                                                        cache_implementation="static"))}
    compiled = {}
    if compile_forward:
        from bitkern.integration.hf import use_grouped_attention

        eager, attention = model.forward, model.config._attn_implementation
        start = time.perf_counter()
        for name, switch in (("sdpa", lambda: model.set_attn_implementation("sdpa")),
                             ("bitkern", lambda: use_grouped_attention(model))):
            switch()
            model.forward = torch.compile(eager, dynamic=False)
            forward_steps(model, prompt, 2, StaticCache(config=model.config, max_cache_len=length))
            ways[f"generate, static cache, torch.compile(forward), attention {name!r}"] = \
                lambda forward=model.forward, switch=switch: _compiled_generate(model, forward, switch, prompt, steps)
            model.forward = eager
        model.set_attn_implementation(attention)
        compiled["compile seconds"] = time.perf_counter() - start
    for way in ways.values():
        way()
    medians = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            medians[name].append(statistics.median(way()) * 1e3)
    result = {name: statistics.median(values) for name, values in medians.items()}
    section("1. decode step (ms, median over rounds of the median step)", ["decoding", "ms per step", "tokens/s"],
            [(name, ms, 1e3 / ms) for name, ms in result.items()])
    if compiled:
        print(f"\ntorch.compile of the forward (both shapes, static cache, both attentions): "
              f"{compiled['compile seconds']:.0f} s")
    return result


def kind_of(name: str, module) -> str:
    """The row of the module table a module's self time goes to."""
    from bitkern.nn.storage import QuantizedModule

    if name == "lm_head":
        return f"lm_head (bitkern {module.weight_dtype})" if isinstance(module, QuantizedModule) else \
            "lm_head (torch bf16 GEMV)"
    if isinstance(module, QuantizedModule) or type(module).__name__ in FUSED_LINEARS:
        return "bitkern Linears of the layers"
    kinds = {"LlamaAttention": "attention core (rope, KV cache update, SDPA, reshapes)", "LlamaRMSNorm": "RMSNorm",
             "LlamaMLP": "SwiGLU elementwise (SiLU, product)", "SiLUActivation": "SwiGLU elementwise (SiLU, product)",
             "SiLU": "SwiGLU elementwise (SiLU, product)", "SwiGLUMLP": "SwiGLU elementwise (SiLU, product)",
             "LlamaDecoderLayer": "residual adds, layer glue",
             "LlamaModel": "model glue (embedding, rotary cos/sin, mask, cache)",
             "Embedding": "model glue (embedding, rotary cos/sin, mask, cache)",
             "LlamaRotaryEmbedding": "model glue (embedding, rotary cos/sin, mask, cache)",
             "LlamaForCausalLM": "CausalLM glue (logits slice, output)", "FoldedNorm": "RMSNorm"}
    return kinds.get(type(module).__name__, type(module).__name__)


def module_table(model, prompt, steps: int, rounds: int) -> None:
    """Self time per module kind in ms per decode step (hooks), generate's own work, and what the hooks cost."""
    names = {module: name for name, module in model.named_modules()}
    stack, forwards, current = [], [], Counter()

    def before(module, args):
        stack.append([module, CLOCK(), 0.0])

    def after(module, args, output):
        _, start, children = stack.pop()
        inclusive = CLOCK() - start
        kind = kind_of(names[module], module)
        current[kind] += inclusive - children
        current["calls: " + kind] += 1
        if stack:
            stack[-1][2] += inclusive
        else:
            forwards.append(dict(current, forward=inclusive))
            current.clear()

    def hooked_steps():
        handles = [h for module in names for h in (module.register_forward_pre_hook(before),
                                                   module.register_forward_hook(after))]
        try:
            return generation_steps(model, prompt, steps + 1, clock=CLOCK, **GENERATE_OPTIONS)
        finally:
            for handle in handles:
                handle.remove()

    plain, hooked, per_round = [], [], []
    for _ in range(rounds):
        plain.append(statistics.median(generation_steps(model, prompt, steps + 1, clock=CLOCK,
                                                        **GENERATE_OPTIONS)))
        forwards.clear()
        hooked.append(statistics.median(hooked_steps()))
        decode = forwards[1:]  # the first forward is the prompt's
        per_round.append({key: statistics.median(f.get(key, 0.0) for f in decode) for key in decode[0]})
    step_ms, hooked_ms = statistics.median(plain) * 1e3, statistics.median(hooked) * 1e3
    median = {key: statistics.median(r[key] for r in per_round) for key in per_round[0]}
    kinds = sorted((k for k in median if not k.startswith("calls: ") and k != "forward"), key=lambda k: -median[k])
    rows = [(kind, median[kind] * 1e3, int(median["calls: " + kind])) for kind in kinds]
    rows.append(("generate's own work (hooked step - its forward)", hooked_ms - median["forward"] * 1e3, ""))
    rows.append(("hooks' own cost (hooked step - plain step)", hooked_ms - step_ms, ""))
    section(f"2. decode step by module kind (medians over steps and rounds; plain step {step_ms:.2f} ms, hooked "
            f"{hooked_ms:.2f} ms)", ["module kind", "self ms per step", "module calls per step"], rows)


def op_table(model, prompt, steps: int) -> None:
    """Ops called from Python per decode step (torch.profiler: top-level events), their count and self time."""
    from torch.profiler import ProfilerActivity, profile

    generation_steps(model, prompt, 4, **GENERATE_OPTIONS)
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        generation_steps(model, prompt, steps + 1, **GENERATE_OPTIONS)
    top = [e for e in trace.events() if e.cpu_parent is None]
    count, total = Counter(e.name for e in top), defaultdict(float)
    for event in top:
        total[event.name] += event.cpu_time_total
    forwards = steps + 1
    rows = [(name, count[name] / forwards, total[name] / forwards / 1e3) for name in
            sorted(count, key=lambda n: -total[n])[:25]]
    section(f"3. ops called from Python per forward (torch.profiler, {len(top) / forwards:.0f} per forward; "
            f"total of their inclusive times {sum(total.values()) / forwards / 1e3:.2f} ms)",
            ["op", "calls per forward", "inclusive ms per forward"], rows)


def call_costs(rounds: int) -> None:
    """µs per call of a small torch op, and of a bitkern Linear at M=1 on a tiny hot weight, layer by layer."""
    import bitkern
    from bitkern.cache import kernel_for
    from bitkern.codegen.cpu.layout import aligned

    layer = bitkern.Linear(256, 64, bias=False, dtype="int4", group_size=128, compute_dtype=torch.bfloat16).eval()
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    a, b = torch.randn(1, 1, 2048, dtype=torch.bfloat16), torch.randn(1, 1, 2048, dtype=torch.bfloat16)
    tensors, weight_format = layer.op_weight()
    weight = layer.packed_weight()
    spec = bitkern.ops.Matmul("int4", "bfloat16", output_dtype="bfloat16", group_size=128, zero_mode=layer.zero_mode)
    kernel = kernel_for(spec, 64, 256, 1, weight.layout, None)
    y = torch.empty(1, 64, dtype=torch.bfloat16)
    raw = (aligned(x), *weight.kernel_arguments(), *kernel.constants, y)
    calls = {"torch: a + b ([1, 1, 2048] bf16)": lambda: a + b,
             "torch: F.silu(a) * b": lambda: torch.nn.functional.silu(a) * b,
             "bitkern.Linear module call": lambda: layer(x),
             "torch.ops.bitkern.linear": lambda: torch.ops.bitkern.linear(x, tensors, weight_format, None,
                                                                          torch.bfloat16),
             "Matmul spec call (packed weight given)": lambda: spec(x, weight),
             "kernel object call": lambda: kernel(x, weight),
             "compiled function (tvm-ffi call)": lambda: kernel.function(*raw)}
    with torch.inference_mode():
        medians = interleaved(calls, rounds=rounds, clock=CLOCK)
    section("4. call costs in isolation (µs per call, hot tiny weight: the kernel's own work ~0)",
            ["call", "µs"], [(name, statistics.median(values) * 1e6) for name, values in medians.items()])


def kernel_table(model, rounds: int, probes) -> None:
    """Each distinct Linear of a layer and the lm_head at M=1, weights rotating through DRAM, one at a time, each
    interleaved with the DRAM probes: ms, bytes, GB/s, and GB/s over the probes' in the same rounds."""
    import bitkern

    from bitkern.fusion.modules import EpilogueLinear

    layer = model.model.layers[0]
    fused = {name + ".layer": name for name, module in layer.named_modules() if isinstance(module, EpilogueLinear)}
    candidates = {fused.get(name, name): layer.get_submodule(fused.get(name, name))
                  for name, module in layer.named_modules() if hasattr(module, "weight_dtype")}
    head = model.lm_head
    dense = torch.nn.Linear(head.in_features, head.out_features, bias=False, dtype=torch.bfloat16)
    if hasattr(head, "weight_dtype"):
        candidates["lm_head (the model's)"] = head
        dense.weight.data.copy_(head.dequantize_weight(torch.bfloat16))
    else:
        dense.weight.data.copy_(head.weight)
    candidates["lm_head torch bf16"] = dense
    for dtype, group in (("bfloat16", -1), ("int8", 128), ("int4", 128)):
        candidates[f"lm_head bitkern {dtype} g{group}"] = bitkern.quantize_model(
            copy.deepcopy(dense), dtype, group_size=group, compute_dtype=torch.bfloat16)
    probe_calls, probe_bytes = probes
    rows = []
    with torch.inference_mode():
        for name, module in candidates.items():
            stored = getattr(module, "layer", module)  # a fused layer (EpilogueLinear): its stacked weight
            size = stored.nbytes if hasattr(stored, "nbytes") else stored.weight.numel() * stored.weight.element_size()
            copies = rotation(lambda module=module: _copy(module), size)
            x = torch.randn(1, 1, stored.in_features, dtype=torch.bfloat16)
            medians = interleaved({"kernel": lambda: copies()(x), **probe_calls}, rounds=rounds, clock=CLOCK)
            del copies
            probe = [min(values) for values in zip(*(medians[p] for p in probe_calls))]  # the faster probe per round
            fraction = statistics.median(probe_s * size / (kernel_s * probe_bytes)
                                         for kernel_s, probe_s in zip(medians["kernel"], probe))
            seconds = statistics.median(medians["kernel"])
            rows.append((name, f"{stored.out_features}x{stored.in_features}", seconds * 1e3, size / 1e6,
                         size / seconds / 1e9, probe_bytes / statistics.median(probe) / 1e9, fraction))
    section("5. kernels alone at M=1, weights from DRAM (per-round ratio to the DRAM probes)",
            ["layer", "N x K", "ms", "MB", "GB/s", "probe GB/s", "fraction of DRAM"], rows)


def _copy(module):
    """A deep copy made outside inference mode, so that its parameters are the plain tensors of the model's own
    layers (a folded norm converts its weight once per version, not per call as for inference tensors)."""
    with torch.inference_mode(False):
        return copy.deepcopy(module)


def glue_table(model, prompt, steps: int, rounds: int) -> None:
    """ms per generate step with the kernels, and with every bitkern CPU kernel call returning zeros of y's shape
    (interleaved per round): what transformers, torch and bitkern's dispatch cost without the kernels' work."""
    from bitkern.codegen.cpu.kernel import CpuKernel
    from bitkern.ttype import torch_dtype

    def no_op(kernel, x, weight, bias=None, residual=None, norm=()):
        return torch.zeros(kernel.spec.rows(x), kernel.spec.out_features(kernel.n),
                           dtype=torch_dtype(kernel.spec.output_dtype))

    real, samples = CpuKernel.__call__, defaultdict(list)
    try:
        for _ in range(rounds):
            for name, call in (("with the kernels", real), ("kernels as no-ops (glue and dispatch)", no_op)):
                CpuKernel.__call__ = call
                samples[name].append(1000 * statistics.median(
                    generation_steps(model, prompt, steps + 1, **GENERATE_OPTIONS)))
    finally:
        CpuKernel.__call__ = real
    medians = {name: statistics.median(values) for name, values in samples.items()}
    section("6. the step without the kernels' work (ms, median over rounds of the median step)", ["decoding", "ms"],
            [*medians.items(), ("difference: the kernels", medians["with the kernels"] -
                                medians["kernels as no-ops (glue and dispatch)"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bitkern int4 g128", choices=list(BITKERN))
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=8, help="prompt tokens before the decode steps")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the forward")
    parser.add_argument("--unfused", action="store_true", help="the model without bitkern.fuse (as before it)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="1 thread, CPU seconds (time.process_time) instead of wall seconds: robust to a "
                             "crowded CPU")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "bitkern-llamacpp")
    args = parser.parse_args()
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
        torch.set_num_threads(1)
    print(f"# decode profile ({'CPU seconds' if args.cpu_time else 'wall seconds'}): {args.dtype}"
          f"{', unfused' if args.unfused else ', bitkern.fuse'}, {args.steps} steps "
          f"after {args.prompt} tokens, {torch.get_num_threads()} "
          f"threads, load average at start {os.getloadavg()}; command: python {' '.join(sys.argv)}")
    model = load_model(make_model(args.cache_dir.expanduser() / "model"), args.dtype, fused=not args.unfused)
    prompt = torch.randint(0, CONFIG["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(1))
    probes = read_probes()
    with torch.inference_mode():
        # prepares the kernels (tuned, built or loaded)
        generation_steps(model, prompt, args.steps + 1, **GENERATE_OPTIONS)
        step_table(model, prompt, args.steps, args.rounds, args.compile)
        module_table(model, prompt, args.steps, args.rounds)
        op_table(model, prompt, args.steps)
    call_costs(args.rounds)
    kernel_table(model, args.rounds, probes)
    with torch.inference_mode():
        glue_table(model, prompt, args.steps, args.rounds)
    print(f"\nload average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
