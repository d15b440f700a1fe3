"""Trajectory comparison: do two training runs of one recipe follow the same path?

Per step and quantity the candidate may differ from the reference by the ``trajectory_band``
budget of :mod:`torchparity.tolerance`,
``|candidate(n) - reference(n)| <= fudge * max(noise(n), noise floor) + floor``, ``noise(n)``
the pooled spread of a rounding-only ensemble (:class:`NoiseBand`), which has measured how
rounding grows over the run: the budget has no growth term of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from torchparity import tolerance
from torchparity.comparison.tensor import Verdict
from torchparity.train.trainer import Trajectory


@dataclass
class Point:
    """One quantity at one step: values, error, budget and the share of it used."""

    step: int
    quantity: str
    candidate: float
    reference: float
    noise: float
    error: float
    budget: float
    headroom: float  # error / budget (inf for a non-finite fault)
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.headroom <= 1.0


@dataclass
class TrajectoryComparison:
    """The verdict on a candidate trajectory, step by step."""

    candidate: str
    reference: str
    calibration: str
    compute_dtype: str
    points: list[Point]
    identical: bool
    notes: list[str] = field(default_factory=list)
    quantities: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.quantities:  # in the order the points name them
            self.quantities = list(dict.fromkeys(p.quantity for p in self.points))

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.points)

    @property
    def verdict(self) -> Verdict:
        if not self.ok:
            return "diverged"
        return "identical" if self.identical else "within"

    @property
    def first_divergence(self) -> Point | None:
        return next((p for p in self.points if not p.ok), None)

    @property
    def worst(self) -> Point | None:
        return max(self.points, key=lambda p: p.headroom, default=None)

    @property
    def max_headroom(self) -> float:
        worst = self.worst
        return worst.headroom if worst else 0.0

    def headroom_by_quantity(self) -> dict[str, float]:
        """The largest share of the budget each quantity used over the run."""
        return {q: max((p.headroom for p in self.points if p.quantity == q), default=0.0)
                for q in self.quantities}

    def sensitivity(self) -> dict[str, float]:
        """Per quantity, the smallest relative change the last step's budget would have flagged."""
        last = max((p.step for p in self.points), default=0)
        return {p.quantity: p.budget / abs(p.reference) if p.reference else math.inf
                for p in self.points if p.step == last}

    def sensitivity_line(self) -> str:
        """``could have detected at step 200: loss 0.0012%, grad_norm 0.03%, ...``."""
        last = max((p.step for p in self.points), default=0)
        parts = ", ".join(f"{q} {_relative(v)}" for q, v in self.sensitivity().items())
        return f"could have detected changes, relative, at step {last}: {parts}"

    def budget_share(self) -> str:
        """``within, 12% of the budget used (loss 3%, grad_norm 12%, update_norm 5%)``."""
        parts = ", ".join(f"{q} {_percent(h)}" for q, h in self.headroom_by_quantity().items())
        return f"{self.verdict}, {_percent(self.max_headroom)} of the budget used ({parts})"

    def explain(self) -> str:
        """One paragraph: verdict, the step and quantity that decided it, error vs budget."""
        head = f"{self.candidate} vs {self.reference} ({self.calibration}, {self.compute_dtype})"
        steps = max((p.step for p in self.points), default=0)
        if self.verdict == "identical":
            return f"identical: {head}: all {steps} steps bit-equal to the reference."
        point = self.first_divergence or self.worst
        if point is None:
            return f"identical: {head}: no steps to compare."
        detail = (f"{point.quantity} at step {point.step}: candidate {point.candidate:.8g}, "
                  f"reference {point.reference:.8g}, error {point.error:.3g} "
                  f"{'exceeds' if not point.ok else 'is within'} the budget {point.budget:.3g} "
                  f"(rounding noise so far {point.noise:.3g}), using {_share(point.headroom)}")
        if point.note:
            detail += f"; {point.note}"
        if self.ok:
            return f"within: {head}: all {steps} steps within budget; closest: {detail}."
        return (f"diverged: {head}: the runs part at step {point.step}; {detail}. "
                "Rerun with --diagnose to drill that step down.")

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "verdict": self.verdict,
            "ok": self.ok,
            "candidate": self.candidate,
            "reference": self.reference,
            "calibration": self.calibration,
            "compute_dtype": self.compute_dtype,
            "first_divergence": None if first is None else {"step": first.step,
                                                            "quantity": first.quantity},
            "max_headroom": _finite(self.max_headroom),
            "headroom_by_quantity": {q: _finite(h)
                                     for q, h in self.headroom_by_quantity().items()},
            "sensitivity": {q: _finite(v) for q, v in self.sensitivity().items()},
            "notes": self.notes,
            "points": [{**vars(p), "headroom": _finite(p.headroom)} for p in self.points],
        }


def _relative(x: float) -> str:
    return "none" if not math.isfinite(x) else f"{100 * x:.2g}%"


@dataclass
class NoiseBand:
    """Per quantity and step, the largest distance of rounding-only runs from the reference."""

    spread: dict[str, torch.Tensor]
    members: list[str]
    compute_dtype: str

    @classmethod
    def measure(cls, reference: Trajectory, members: list[Trajectory],
                compute_dtype: str) -> NoiseBand:
        """The band of ``members`` around ``reference`` (infinite where a member is not finite)."""
        ref = reference.series()
        steps = len(reference.records)
        spread = {}
        for q in reference.quantities():
            distances = torch.stack([(m.series()[q][:steps] - ref[q]).abs()
                                     for m in members])
            spread[q] = distances.nan_to_num(nan=math.inf).max(dim=0).values
        return cls(spread, [_member_label(m) for m in members], compute_dtype)

    def pooled(self, quantity: str) -> torch.Tensor:
        """The spread of ``quantity`` at each step, the largest within ``pool_steps`` of it."""
        width = tolerance.KINDS["trajectory_band"].pool_steps
        x = self.spread[quantity]
        if not width or x.numel() == 0:
            return x
        padded = torch.nn.functional.pad(x[None, None], (width, width), value=0.0)
        return torch.nn.functional.max_pool1d(padded, 2 * width + 1, stride=1)[0, 0]

    def label(self) -> str:
        return f"noise band of {len(self.members)} rounding-only runs"


def _member_label(run: Trajectory) -> str:
    rounding = getattr(run.config, "rounding", None)
    return f"{run.label()}, {rounding}" if rounding else run.label()


def _percent(headroom: float) -> str:
    if headroom >= 10:
        return f"{headroom:.3g}x"
    return f"{headroom:.0%}" if headroom >= 0.1 else f"{100 * headroom:.2g}%"


def compare_trajectories(candidate: Trajectory, reference: Trajectory, band: NoiseBand, *,
                         compute_dtype: str | None = None) -> TrajectoryComparison:
    """Judge ``candidate`` against ``reference`` step by step within ``band``.

    Args:
        candidate: the run judged.
        reference: the float64 golden, or the plain run ``band`` was measured around, with at
            least the candidate's steps.
        band: the noise band around ``reference``.
        compute_dtype: sets the unit roundoff of the floor (default: the candidate's dtype).

    Returns:
        The comparison: bit-equal is ``identical``; a non-finite value where the reference is
        finite diverges, unless a band member overflowed at that step too (fp16 loss scaling).
    """
    _check_compatible([candidate, reference])
    steps = len(candidate.records)
    dtype = compute_dtype or candidate.execution.mode.compute_dtype
    quantities = [q for q in candidate.quantities() if q in reference.quantities()]
    envelopes = {q: band.pooled(q)[:steps] for q in quantities}
    cand, ref = candidate.series(), reference.series()
    points = [_point(q, n, cand[q][n - 1].item(), ref[q][n - 1].item(),
                     envelopes[q][n - 1].item(), dtype, _skipped_by_both(candidate, band, n))
              for q in quantities for n in range(1, steps + 1)]
    points.sort(key=lambda p: (p.step, quantities.index(p.quantity)))
    return TrajectoryComparison(candidate.label(), reference.label(), band.label(), dtype,
                                points, _bit_equal(cand, ref, steps), list(candidate.notes),
                                quantities)


def _point(quantity: str, step: int, candidate: float, reference: float, noise: float,
           dtype: str, excused: bool) -> Point:
    if excused and quantity != "loss":
        return Point(step, quantity, candidate, reference, noise, 0.0, math.inf, 0.0,
                     "step skipped by fp16 loss scaling in the candidate and in the band")
    budget = tolerance.band_budget(reference, noise if math.isfinite(noise) else 0.0,
                                   dtype).value
    if not math.isfinite(noise):
        budget = math.inf
    if not math.isfinite(candidate) and math.isfinite(reference):
        return Point(step, quantity, candidate, reference, noise, math.inf, budget, math.inf,
                     f"candidate {quantity} is {candidate} where the reference is finite")
    error = abs(candidate - reference)
    headroom = error / budget if math.isfinite(budget) else 0.0
    return Point(step, quantity, candidate, reference, noise, error, budget, headroom)


def _skipped_by_both(candidate: Trajectory, band: NoiseBand, step: int) -> bool:
    # A member whose fp16 step overflowed has an infinite gradient norm there: an infinite band.
    spread = band.spread["grad_norm"]
    return (candidate.records[step - 1].skipped and step <= spread.numel()
            and not math.isfinite(spread[step - 1].item()))


def _bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], steps: int) -> bool:
    return all(torch.equal(a[q][:steps], b[q][:steps]) for q in a if q in b)


def _check_compatible(runs: list[Trajectory]) -> None:
    recipe = runs[0].config
    for run in runs[1:]:
        if run.config.same_recipe() != recipe.same_recipe():
            raise ValueError(f"trajectories of different recipes cannot be compared: "
                             f"{run.config} vs {recipe}")
        if len(run.records) < len(runs[0].records):
            raise ValueError(f"the reference has {len(run.records)} steps, fewer "
                             f"than the candidate's {len(runs[0].records)}")


def _share(headroom: float) -> str:
    if math.isinf(headroom):
        return "all of it (a non-finite value)"
    return f"{headroom:.0%} of it" if headroom < 10 else f"{headroom:.3g} times it"


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else "inf")
