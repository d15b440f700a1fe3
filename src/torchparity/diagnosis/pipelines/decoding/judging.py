"""Judging a decoding: each step's logits, the first divergent module at the first step that
leaves its budget, and each sequence's first token flip with its verdict.

B's logits at each step are judged against the golden's with A's as the baseline; at the
first step that breaks its budget B's module outputs are judged alike, and the first module
that breaks it while its inputs do not is where B computes something else. A *token flip*
(B's greedy choice differs from A's) is a ``near tie`` when noise explains it, a ``real
change`` when B's float64 decoding prefers another token than the golden beyond float64
rounding, or, without it, when the margin exceeds twice the step's budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from torchparity import tolerance
from torchparity.diagnosis.core.decode_reference import DecodeReference
from torchparity.diagnosis.core.judging import judge
from torchparity.diagnosis.core.results import Result, Row

FlipKind = Literal["near tie", "real change"]


@dataclass(frozen=True)
class Flip:
    """The first step where B's greedy token differs from A's in one sequence: A's top-1 minus
    top-2 margin, B's largest logit error there, the step's budget, the verdict."""

    step: int
    sequence: int
    a_token: int
    b_token: int
    margin: float
    change: float
    budget: float | None
    verdict: FlipKind

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "sequence": self.sequence, "a_token": self.a_token,
                "b_token": self.b_token, "margin": self.margin, "change": self.change,
                "budget": self.budget, "verdict": self.verdict}


def judge_steps(reference: DecodeReference, logits: list[torch.Tensor]) -> list[Result]:
    """B's next-token logits of every step against the golden's, A's as the baseline."""
    results = []
    for step, candidate in enumerate(logits):
        golden = {"logits": reference.golden_logits[step]} if reference.has_golden else {}
        results.append(judge({"logits": candidate}, golden, {"logits": reference.logits[step]},
                             "forward"))
    return results


def step_budget(result: Result) -> float | None:
    """The budget of a step's logits (None when they could not be judged)."""
    tensors = getattr(result, "tensors", [])
    return tensors[0].budget.value if tensors and tensors[0].budget is not None else None


def step_error(result: Result) -> float | None:
    tensors = getattr(result, "tensors", [])
    return tensors[0].error if tensors else None


# --------------------------------------------------------------------------------------------
# Modules at one step


def first_module(rows: list[Row]) -> Row | None:
    """The first row (in the order B's calls finished) whose output breaks its budget while
    its inputs do not (or cannot be judged); else the first that breaks it."""
    broken = [r for r in rows if r.propagated is not None and not r.propagated.ok]
    origin = (r for r in broken if r.inputs is None or r.inputs.ok)
    return next(origin, broken[0] if broken else None)


# --------------------------------------------------------------------------------------------
# Token flips


def first_flips(reference: DecodeReference, logits: list[torch.Tensor], steps: list[Result],
                logits64: list[torch.Tensor] | None) -> list[Flip]:
    """Per sequence, the first step where B's greedy token differs from A's, with its verdict
    (``logits64``: B's float64 decoding along the same tokens, None without one)."""
    flips = []
    for sequence in range(logits[0].shape[0]):
        for step, (a_row, b_row) in enumerate(zip((t[sequence] for t in reference.logits),
                                                  (t[sequence] for t in logits), strict=True)):
            a_token, b_token = int(a_row.argmax()), int(b_row.argmax())
            if a_token == b_token:
                continue
            golden = reference.golden_logits[step][sequence] if reference.has_golden else a_row
            top = a_row.double().topk(2).values
            budget = step_budget(steps[step])
            flips.append(Flip(
                step=step, sequence=sequence, a_token=a_token, b_token=b_token,
                margin=float(top[0] - top[1]), change=_change(b_row, golden), budget=budget,
                verdict=flip_verdict(a_row, golden, a_token, b_token, budget,
                                 None if logits64 is None else logits64[step][sequence])))
            break
    return flips


def _change(row: torch.Tensor, golden: torch.Tensor) -> float:
    """The largest difference of one sequence's logits from the golden's, masked entries
    (banned tokens) left out."""
    judged = (row > tolerance.MASKED_BELOW) & (golden > tolerance.MASKED_BELOW)
    return float((row.double() - golden.double())[judged].abs().max()) if judged.any() else 0.0


def flip_verdict(a_row: torch.Tensor, golden: torch.Tensor, a_choice: int, b_choice: int,
                 budget: float | None, row64: torch.Tensor | None,
                 among: tuple[int, ...] | None = None) -> FlipKind:
    """``real change`` when B's float64 scores ``row64`` prefer another candidate ``among``
    than the golden beyond float64 rounding; without them, when A's margin exceeds twice the
    step's budget."""
    if row64 is not None:
        row64 = row64.double()
        candidates = torch.tensor(among) if among is not None else torch.arange(len(golden))
        chosen = int(candidates[golden.double()[candidates].argmax()])  # A without noise
        judged = row64[row64 > tolerance.MASKED_BELOW]
        tie = tolerance.budget(tolerance.Measurement(judged, baseline_error=None,
                                                     compute_dtype="fp64")).value
        others = row64[candidates[candidates != chosen]]
        return "real change" if float(others.max() - row64[chosen]) > tie else "near tie"
    margin = float(a_row[a_choice].double() - a_row[b_choice].double())
    return "near tie" if budget is not None and margin <= 2 * budget else "real change"
