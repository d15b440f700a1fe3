"""Judging a sampled decoding: per sequence, the first step where B, given A's uniform ``u``,
draws another token than A, and whether that is a near tie: ``u`` lies within the step's
noise budget, carried to probabilities (``sampling.probability_noise``), of the boundary
that moved; else a real change."""

from __future__ import annotations

import torch

from torchparity.diagnosis.core.decode_reference import DecodeReference
from torchparity.diagnosis.core.results import Result
from torchparity.diagnosis.pipelines.decoding.judging import Flip, step_budget
from torchparity.subject.sampling import (
    SampleSettings,
    drawn,
    moved_boundary,
    probabilities,
    probability_noise,
    uniforms,
)


def first_changed_draws(reference: DecodeReference, logits: list[torch.Tensor],
                        steps: list[Result], settings: SampleSettings) -> list[Flip]:
    """Per sequence, the first step whose draw from B's logits differs from A's, as a :class:`Flip`
    (margin: the uniform's distance from the boundary; budget in probability)."""
    rows = logits[0].shape[0]
    u = uniforms(settings.seed, len(logits), rows)
    changed = []
    for sequence in range(rows):
        for step, (a_row, b_row) in enumerate(zip((t[sequence] for t in reference.logits),
                                                  (t[sequence] for t in logits), strict=True)):
            draw = u[step, sequence:sequence + 1]
            a_probs, b_probs = (probabilities(r[None], settings) for r in (a_row, b_row))
            a_token, b_token = int(drawn(a_probs, draw)), int(drawn(b_probs, draw))
            if a_token == b_token:
                continue
            boundary = moved_boundary(a_probs[0], a_token, b_token)
            noise = step_budget(steps[step])
            budget = None if noise is None else probability_noise(noise, settings.temperature)
            distance = abs(float(draw) - boundary)
            changed.append(Flip(
                step=step, sequence=sequence, a_token=a_token, b_token=b_token, margin=distance,
                change=abs(moved_boundary(b_probs[0], a_token, b_token) - boundary),
                budget=budget,
                verdict="near tie" if budget is not None and distance <= budget
                else "real change"))
            break
    return changed
