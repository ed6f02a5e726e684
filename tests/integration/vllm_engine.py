"""Runs inside the vLLM test environment (see conftest.py): starts real vLLM engines on a local checkpoint and
writes what the tests compare to a JSON file.

    python vllm_engine.py REQUEST.json

REQUEST holds "engine" (keyword arguments of vllm.LLM), "prompts" (token id lists), "max_tokens", "result" (the
JSON file to write: greedy "tokens" per prompt) and optionally "weights" (a folder: every bitkern layer's
dequantized weight is saved there, one file per tensor-parallel rank) and "ignore_eos" (generate max_tokens
tokens whatever they are).  With "cases" (a list of "engine" keyword
sets) instead, it starts each and records the error it raises, or "started".
"""

import functools
import json
import sys


def save_weights(directory, model):
    """(run by vLLM in each worker) The float32 weight every bitkern layer of this rank computes with."""
    import torch
    from vllm.distributed import get_tensor_model_parallel_rank

    from bitkern.integration.vllm_plugin.linear_method import QUANTIZED

    weights = {name: getattr(module, QUANTIZED).dequantize_weight(torch.float32)
               for name, module in model.named_modules() if hasattr(module, QUANTIZED)}
    torch.save(weights, f"{directory}/rank{get_tensor_model_parallel_rank()}.pt")


def generate(request):
    from vllm import LLM, SamplingParams

    llm = LLM(**request["engine"])
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in request["prompts"]],
                           SamplingParams(max_tokens=request["max_tokens"], temperature=0, detokenize=False,
                                          ignore_eos=request.get("ignore_eos", False)))
    if request.get("weights"):
        llm.apply_model(functools.partial(save_weights, request["weights"]))
    return {"tokens": [list(output.outputs[0].token_ids) for output in outputs]}


def start_each(request):
    from vllm import LLM

    outcomes = []
    for engine in request["cases"]:
        try:
            llm = LLM(**engine)
        except Exception as error:  # noqa: BLE001  (the test reads which error each case raised)
            outcomes.append({"error": type(error).__name__, "message": str(error)})
        else:
            llm.llm_engine.engine_core.shutdown()
            outcomes.append({"error": None, "message": "started"})
    return {"outcomes": outcomes}


def main():
    with open(sys.argv[1]) as file:
        request = json.load(file)
    result = start_each(request) if "cases" in request else generate(request)
    with open(request["result"], "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main()
