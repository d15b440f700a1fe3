"""Repeated draws of one comparison: how a candidate's error relates to the baseline's."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchparity.comparison import Comparison, compare
from torchparity.subject.trees import PyTree
from torchparity.tolerance import DtypeLike


@dataclass(frozen=True)
class Calibration:
    """How a candidate's error relates to the baseline's over many random draws: the largest
    error ratio per draw, the worst headroom per draw, the seeds that failed."""

    kind: str
    draws: int
    ratios: tuple[float, ...]
    headrooms: tuple[float, ...]
    failures: tuple[int, ...]

    def quantile(self, q: float) -> float:
        """The ``q`` quantile of the ratios (nan when no draw had an inexact baseline)."""
        if not self.ratios:
            return math.nan
        return torch.quantile(torch.tensor(self.ratios, dtype=torch.float64), q).item()

    @property
    def quantiles(self) -> dict[float, float]:
        """Median, 90th and 99th percentile of the ratios."""
        return {q: self.quantile(q) for q in (0.5, 0.9, 0.99)}

    @property
    def max_ratio(self) -> float:
        """The largest observed ratio (nan when none was observed)."""
        return max(self.ratios, default=math.nan)

    @property
    def max_headroom(self) -> float:
        """The largest share of the budget any draw used."""
        return max(self.headrooms, default=math.nan)


def calibrate_draws(
    candidate_fn: Callable[[int], PyTree],
    baseline_fn: Callable[[int], PyTree],
    golden_fn: Callable[[int], PyTree],
    draws: int,
    *,
    kind: str = "forward",
    seed: int = 0,
    compute_dtype: DtypeLike | None = None,
    reduction_length: int | None = None,
) -> Calibration:
    """Run ``draws`` draws and collect the candidate/baseline error ratios and verdicts; each
    function builds the same problem from the draw's seed and returns comparable pytrees."""
    ratios: list[float] = []
    headrooms: list[float] = []
    failures: list[int] = []
    for draw_seed in range(seed, seed + draws):
        result = compare(
            candidate_fn(draw_seed),
            golden_fn(draw_seed),
            baseline_fn(draw_seed),
            kind,
            compute_dtype=compute_dtype,
            reduction_length=reduction_length,
        )
        draw_ratio = baseline_ratio(result)
        if draw_ratio is not None:
            ratios.append(draw_ratio)
        headrooms.append(max((t.headroom for t in result.tensors), default=0.0))
        if not result.ok:
            failures.append(draw_seed)
    return Calibration(kind, draws, tuple(ratios), tuple(headrooms), tuple(failures))


def baseline_ratio(comparison: Comparison) -> float | None:
    """The largest err(candidate)/err(baseline) over tensors with an inexact baseline; None
    without."""
    ratios = [
        t.error / t.budget.baseline_error
        for t in comparison.tensors
        if t.budget is not None and t.budget.baseline_error is not None
    ]
    return max(ratios, default=None)
