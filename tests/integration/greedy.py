"""Greedy generation with transformers, the vLLM tests' reference, and the comparison that lets a served token
differ from it only at a step where the reference's top two logits are a near tie (two stacks that round
differently may take either of two near-equal tokens; after that the sequences part ways)."""

import torch


def greedy_tokens(model, prompts, new_tokens, **generate_options):
    """(tokens per prompt, top-2 logit margin per step per prompt) of greedy generation."""
    tokens, margins = [], []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, **generate_options)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            top2 = [score[0].float().topk(2).values for score in out.scores]
            margins.append([float(a - b) for a, b in top2])
    return tokens, margins


def assert_greedy_agrees(served, expected, margins, near_tie):
    """Each served sequence equals the reference's up to its first difference, which must fall on a step whose
    reference margin is below `near_tie`."""
    assert len(served) == len(expected)
    for tokens, reference, margin in zip(served, expected, margins):
        differ = [step for step, (a, b) in enumerate(zip(tokens, reference)) if a != b]
        assert not differ or margin[differ[0]] < near_tie, (tokens, reference, margin)
