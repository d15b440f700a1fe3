"""Seeded sampling on the step protocol, the same draw on every machine and for every side.

Sampling is by inverse CDF of the logits (in float64) over ``temperature``, cut to the ``top_k``
largest, then to the smallest set reaching ``top_p``, renormalised: two sides given the same
uniforms draw the same token unless a boundary of the CDF moved across ``u``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

#: Defaults of the command line and of :class:`SampleSettings` (those of ``generate``).
TEMPERATURE, SEED = 1.0, 0


@dataclass(frozen=True)
class SampleSettings:
    """How a decoding samples: ``top_k`` None keeps every token, ``top_p`` None cuts no nucleus."""

    temperature: float = TEMPERATURE
    top_k: int | None = None
    top_p: float | None = None
    seed: int = SEED

    def to_dict(self) -> dict[str, object]:
        """The settings as a report's JSON writes them."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "seed": self.seed}


def uniforms(seed: int, steps: int, rows: int) -> torch.Tensor:
    """The (steps, rows) float64 uniforms in [0, 1) of every step and row, from Python's."""
    # Mersenne Twister: the same numbers on every machine and device, unlike a device's generator
    draw = random.Random(seed)
    return torch.tensor([[draw.random() for _ in range(rows)] for _ in range(steps)],
                        dtype=torch.float64)


def probabilities(logits: torch.Tensor, settings: SampleSettings) -> torch.Tensor:
    """The (rows, vocab) float64 distribution of ``logits``: temperature, top-k, top-p."""
    scaled = logits.double() / settings.temperature
    if settings.top_k is not None and settings.top_k < scaled.shape[-1]:
        kth = scaled.topk(settings.top_k, -1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if settings.top_p is not None:
        ordered, order = probs.sort(-1, descending=True)
        before = ordered.cumsum(-1) - ordered  # the mass of the tokens ranked above
        cut = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order,
                                                                before >= settings.top_p)
        probs = probs.masked_fill(cut, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def drawn(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The (rows,) tokens drawn by the (rows,) uniforms ``u`` from ``probs``, by inverse CDF."""
    cdf = probs.cumsum(-1)
    # the first token whose cumulative probability exceeds u
    index = torch.searchsorted(cdf, u.to(cdf.dtype)[:, None], right=True)[:, 0]
    return index.clamp(max=probs.shape[-1] - 1)


def moved_boundary(probs: torch.Tensor, a_token: int, b_token: int) -> float:
    """The cumulative probability at the boundary a draw crossed between two sides' tokens."""
    cdf = probs.cumsum(-1)
    return float(cdf[a_token] if b_token > a_token else cdf[a_token] - probs[a_token])


def probability_noise(logit_noise: float, temperature: float) -> float:
    """How far a cumulative probability moves when every logit moves by ``logit_noise``."""
    # each probability changes by a factor within exp(+-2 noise / T): a uniform nearer a boundary
    # than this may draw another token for rounding alone
    return math.expm1(2 * logit_noise / temperature)


@dataclass
class Sampler:
    """The ``decide`` of :func:`~torchparity.subject.decoding.teacher_forced` that samples."""

    settings: SampleSettings
    steps: int
    rows: int
    u: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.u = uniforms(self.settings.seed, self.steps, self.rows)

    def decide(self, step: int, logits: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The (rows,) tokens of ``step`` (from 1) drawn by its uniforms, and no parents."""
        return drawn(probabilities(logits.cpu(), self.settings), self.u[step - 1]), None
