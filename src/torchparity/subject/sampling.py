"""Seeded sampling on the step protocol, the same draw on every machine and for every side.

torchparity draws the uniforms itself (Python's Mersenne Twister, seeded: the same numbers on
every machine and instruction set, unlike a device's generator) and samples by inverse CDF:
the logits (in float64) over ``temperature``, cut to the ``top_k`` largest and then to the
smallest set whose probability reaches ``top_p``, renormalised; the token drawn by uniform
``u`` is the first, in vocabulary order, whose cumulative probability exceeds ``u``. Two sides
given the same uniforms draw the same token unless a boundary of the cumulative distribution
moved across ``u`` (:func:`moved_boundary`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import torch

#: Defaults of the command line and of :class:`SampleSettings` (those of ``generate``).
TEMPERATURE, SEED = 1.0, 0


@dataclass(frozen=True)
class SampleSettings:
    """How a decoding samples: ``temperature``, ``top_k`` (None: every token), ``top_p``
    (None: no nucleus cut), and the ``seed`` of the uniforms."""

    temperature: float = TEMPERATURE
    top_k: int | None = None
    top_p: float | None = None
    seed: int = SEED

    def to_dict(self) -> dict[str, Any]:
        """The settings as a report's JSON writes them.

        Returns:
            ``temperature``, ``top_k``, ``top_p`` and ``seed`` by name.
        """
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "seed": self.seed}


def uniforms(seed: int, steps: int, rows: int) -> torch.Tensor:
    """The uniforms in [0, 1) of every step and row, from Python's generator.

    Python's Mersenne Twister gives the same numbers on every machine and device, so two
    sides, or two runs, sample with the same draws.

    Args:
        seed: the draws' seed.
        steps: the decoding steps.
        rows: the rows sampled at each step.

    Returns:
        (steps, rows) float64.
    """
    draw = random.Random(seed)
    return torch.tensor([[draw.random() for _ in range(rows)] for _ in range(steps)],
                        dtype=torch.float64)


def probabilities(logits: torch.Tensor, settings: SampleSettings) -> torch.Tensor:
    """The processed distribution of ``logits``: temperature, top-k, top-p, renormalised.

    Args:
        logits: (rows, vocab).
        settings: the temperature and cuts.

    Returns:
        (rows, vocab) float64, tokens cut off having probability 0.
    """
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
    """The token of every row drawn by its uniform, by inverse CDF.

    Args:
        probs: (rows, vocab) probabilities.
        u: (rows,) uniforms in [0, 1).

    Returns:
        (rows,) token ids.
    """
    cdf = probs.cumsum(-1)
    index = torch.searchsorted(cdf, u.to(cdf.dtype)[:, None], right=True)[:, 0]
    return index.clamp(max=probs.shape[-1] - 1)


def moved_boundary(probs: torch.Tensor, a_token: int, b_token: int) -> float:
    """Where a draw of one token crossed into the other's interval of the cumulative distribution.

    Args:
        probs: (vocab,) one row's probabilities.
        a_token: the token one side drew.
        b_token: the token the other side drew.

    Returns:
        The cumulative probability at the boundary between their intervals.
    """
    cdf = probs.cumsum(-1)
    return float(cdf[a_token] if b_token > a_token else cdf[a_token] - probs[a_token])


def probability_noise(logit_noise: float, temperature: float) -> float:
    """How far a cumulative probability can move when every logit moves by at most ``logit_noise``.

    Each probability changes by a factor within exp(+-2 * noise / T), so a cumulative one (of
    any renormalised subset) by at most ``expm1(2 * noise / T)``: a uniform nearer a boundary
    than that may draw another token for rounding alone.

    Args:
        logit_noise: the largest move of any logit.
        temperature: the sampling temperature T.

    Returns:
        The bound on a cumulative probability's move.
    """
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
        """The tokens of ``step``, drawn from ``logits`` by the step's uniforms.

        Args:
            step: the step, from 1.
            logits: (rows, vocab).

        Returns:
            The tokens (rows,), and None: every row continues itself.
        """
        return drawn(probabilities(logits.cpu(), self.settings), self.u[step - 1]), None
