"""The warm-up forwards of `bitkern.prepare` on a transformers model: one forward per M bucket of the small token
counts, so that what a first call pays outside bitkern's kernels (torch's first calls of the layers left in float,
such as the output layer, and transformers' first-call setup) is paid before the first request instead of in it."""

from __future__ import annotations

import logging

import torch

from ...tuner.buckets import m_bucket

log = logging.getLogger("bitkern")

# Counts above this are prepared but not run: a forward that long hides a first call's milliseconds, and running
# it would add a whole prompt's time to start-up.
WARMUP_MAX_TOKENS = 128


def warm_up(model, counts: tuple[int, ...]) -> tuple[int, ...]:
    """Run `model` once on `input_ids` of the smallest count of each M bucket of `counts` up to WARMUP_MAX_TOKENS
    (one sequence, token id 0, no gradients); returns the counts run.  Skipped, and logged, where such a forward
    is not the model's: a model in training mode (dropout would draw from the user's random stream), one whose
    main input is not `input_ids`, an encoder-decoder, a count past the model's positions, and the counts from a
    forward that raised on."""
    counts = tuple(sorted({m_bucket(t): t for t in sorted(counts, reverse=True) if t <= WARMUP_MAX_TOKENS}.values()))
    config = model.config
    reason = ("the model is in training mode" if model.training else
              f"its main input is {model.main_input_name!r}, not input_ids" if model.main_input_name != "input_ids"
              else "it is an encoder-decoder" if getattr(config, "is_encoder_decoder", False) else None)
    if reason is not None:
        log.info("bitkern.prepare: no warm-up forward (%s); the first call pays torch's and transformers' first-call "
                 "costs", reason)
        return ()
    positions = getattr(config, "max_position_embeddings", None)
    runnable = tuple(t for t in counts if positions is None or t <= positions)
    if runnable != counts:
        log.info("bitkern.prepare: no warm-up forward at %s tokens (past the model's %d positions)",
                 sorted(set(counts) - set(runnable)), positions)
    ran = []
    with torch.inference_mode():
        for t in runnable:
            try:
                model(input_ids=torch.zeros((1, t), dtype=torch.long, device=model.device))
            except Exception as error:  # the kernels are ready: a forward this model cannot take costs only its warm-up
                log.warning("bitkern.prepare: the warm-up forward at %d tokens failed (%s: %s); the first call pays "
                            "torch's and transformers' first-call costs", t, type(error).__name__, error)
                break
            ran.append(t)
    if ran:
        log.info("bitkern.prepare: warmed up with a forward at %s tokens", ", ".join(map(str, ran)))
    return tuple(ran)
