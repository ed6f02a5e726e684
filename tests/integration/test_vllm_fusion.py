"""bitkern's fusions inside a real vLLM CPU engine (`quantization="bitkern"`, vLLM's default compiled mode): the
tiny Llama of test_vllm_plugin.py served with the fusions off, on (every match) and auto (the cost model decides,
the default) generates the same greedy tokens, and vLLM's torch profiler counts the bitkern kernel calls of the
generation: with the fusions, `bitkern::linear_epilogue` calls take the place of exactly as many `bitkern::linear`
calls (SwiGLU: gate_up + SiluAndMul in one kernel; residual adds folded into o_proj and down_proj), as the
decisions the pass logs say.  A bad switch value, and the switch on in an engine that does not compile, fail at
engine start, naming the problem."""

import re

import pytest

from tests.integration.test_vllm_plugin import INT4, MAX_TOKENS, PROMPTS, engine

SWITCH = "BITKERN_VLLM_FUSION"
LINEAR, EPILOGUE = "bitkern::linear", "bitkern::linear_epilogue"
LAYERS, LINEARS_PER_LAYER = 2, 4  # the tiny Llama: qkv, o, gate_up, down in each of its 2 layers
DECISION = re.compile(r"bitkern fusion: (\w+) at ([\d and]+) rows, modeled gain ([\d.]+)x: (fused|kept unfused)")


def serve(run_vllm, tiny_llama, folder, switch, eager=False):
    """(greedy tokens, {bitkern op: calls while generating}, [(pattern, fused)] the pass logged) of one engine,
    with its own compile cache; no kernel is tuned once it has started (the pass makes its fused calls' kernels
    ready at every token count, as the linear method does the layers' own)."""
    result, output = run_vllm({"engine": engine(tiny_llama, "float32", INT4, eager), "prompts": PROMPTS,
                               "max_tokens": MAX_TOKENS, "profile": str(folder / "profile"),
                               "no_tuning_after_start": True},
                              {SWITCH: switch, "VLLM_CACHE_ROOT": str(folder / "cache")})
    decisions = [(pattern, verdict == "fused") for pattern, _, _, verdict in DECISION.findall(output)]
    return result["tokens"], result["bitkern_calls"], decisions


@pytest.fixture(scope="module")
def unfused(run_vllm, tiny_llama, tmp_path_factory):
    return serve(run_vllm, tiny_llama, tmp_path_factory.mktemp("fusion-off"), "off")


def forwards(calls) -> int:
    """Forward passes in an engine's profile: each calls every bitkern layer once, fused or not (engines may take
    a different number of steps for the same tokens, so each is counted on its own profile)."""
    total = calls.get(LINEAR, 0) + calls.get(EPILOGUE, 0)
    assert total and total % (LAYERS * LINEARS_PER_LAYER) == 0, calls
    return total // (LAYERS * LINEARS_PER_LAYER)


def test_every_fusion_keeps_the_tokens_and_runs_the_fused_kernels(run_vllm, tiny_llama, tmp_path, unfused):
    """Switch on: each layer's SwiGLU and both residual adds become linear_epilogue calls; only q/k/v stays a
    plain linear."""
    tokens, calls, decisions = serve(run_vllm, tiny_llama, tmp_path, "on")
    reference_tokens, reference_calls, reference_decisions = unfused
    assert reference_decisions == []  # off: no pass
    assert tokens == reference_tokens
    assert EPILOGUE not in reference_calls
    assert ("swiglu", True) in decisions and ("residual", True) in decisions and all(f for _, f in decisions)
    steps = forwards(calls)
    assert calls == {LINEAR: steps * LAYERS, EPILOGUE: steps * LAYERS * 3}


def test_auto_fuses_as_the_cost_model_decides(run_vllm, tiny_llama, tmp_path, unfused):
    """The default: one decision per pattern and layer signature (the SwiGLU of gate_up, the residual adds after
    o_proj and after down_proj; both layers share them), and the fused calls are the ones it decided to fuse."""
    tokens, calls, decisions = serve(run_vllm, tiny_llama, tmp_path, "auto")
    reference_tokens, reference_calls, _ = unfused
    assert tokens == reference_tokens
    assert sorted(pattern for pattern, _ in decisions) == ["residual", "residual", "swiglu"], decisions
    steps = forwards(calls)
    assert calls.get(EPILOGUE, 0) == steps * LAYERS * sum(fused for _, fused in decisions)
    assert forwards(reference_calls) > 0 and EPILOGUE not in reference_calls


@pytest.mark.parametrize("switch, eager, message", [
    ("fast", False, f"{SWITCH}='fast' is not a choice; accepted: ['auto', 'on', 'off']"),
    ("on", True, f"{SWITCH}=on: bitkern's fusions need vLLM's compiled mode with the Inductor backend, but this "
                 f"engine runs eager"),
], ids=["unknown-value", "on-but-eager"])
def test_bad_switch_fails_at_engine_start(run_vllm, tiny_llama, switch, eager, message):
    result, _ = run_vllm({"cases": [engine(tiny_llama, "float32", INT4, eager)]}, {SWITCH: switch})
    outcome = result["outcomes"][0]
    assert outcome["error"] is not None and message in outcome["message"], outcome
