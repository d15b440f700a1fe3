"""The determinism probe: which ops give other outputs when the same model runs again.

The model runs three times with every op captured: twice as it is (no reseed: a seedless
dropout draws anew), then under another thread count (reductions split otherwise). An op is
named where a difference enters (inputs bit-equal, outputs not). A run-to-run difference is
nondeterminism; one under threads is rounding, which budgets must allow.
:func:`run_to_run_spreads` measures the first kind for the drill-down's budgets."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torchparity import sketching, tolerance
from torchparity.diagnosis.core.capture import CallArgs
from torchparity.diagnosis.stages.ops.capture import Step, capture_steps
from torchparity.sketching import Sketch
from torchparity.subject.running import Inputs
from torchparity.threads import torch_threads

__all__ = ["Determinism", "probe_determinism", "run_to_run_spreads"]


@dataclass
class Determinism:
    """Where two runs of one model part: the steps where a difference enters between runs, and
    under ``threads`` threads (those not already listed)."""

    between_runs: list[Step]
    under_threads: list[Step]
    threads: int
    steps: int

    @property
    def deterministic(self) -> bool:
        return not self.between_runs

    def lines(self) -> list[str]:
        """One sentence, then one line per op named, its source line whole."""
        if not self.between_runs and not self.under_threads:
            return [f"Deterministic: {self.steps} ops give bit-equal outputs in two runs and "
                    f"under {self.threads} thread(s)."]
        out = [f"{len(self.between_runs)} op(s) differ between two runs (nondeterministic); "
               f"{len(self.under_threads)} more under {self.threads} thread(s) (a reduction "
               "split otherwise: rounding)."]
        for why, steps in (("between two runs", self.between_runs),
                           (f"under {self.threads} thread(s)", self.under_threads)):
            out += [f"{step.name} differs {why} at {_where(step)}" for step in steps]
        return out

    def to_dict(self) -> dict:
        def dump(steps: list[Step]) -> list[dict]:
            return [{"name": s.name, "stack": [str(f) for f in s.stack], "code": s.code}
                    for s in steps]

        return {"deterministic": self.deterministic, "steps": self.steps,
                "threads": self.threads, "between_runs": dump(self.between_runs),
                "under_threads": dump(self.under_threads)}


def probe_determinism(model: nn.Module, inputs: Inputs, threads: int | None = None
                      ) -> Determinism:
    """Run ``model`` on ``inputs`` twice, then under ``threads`` threads (default: one when
    torch uses more, else two), and name the ops where the runs part."""
    args, kwargs = _as_call(inputs)
    first = capture_steps(model, args, kwargs, children=False)
    second = capture_steps(model, args, kwargs, children=False)
    other = threads or (1 if torch.get_num_threads() > 1 else 2)
    with torch_threads(other):
        third = capture_steps(model, args, kwargs, children=False)
    between = _entries(first, second)
    seen = {step.index for step in between}
    under = [step for step in _entries(first, third) if step.index not in seen]
    return Determinism(between, under, other, len(first))


def _entries(first: list[Step], again: list[Step]) -> list[Step]:
    """The steps of ``again`` whose outputs differ from ``first``'s while their inputs do not;
    uninitialised memory is no difference."""
    found = []
    for a, b in zip(first, again, strict=False):
        if a.name != b.name:
            found.append(b)  # the code took another path: it enters here
            break
        if _uninitialised(a):
            continue
        inputs_equal = all(_equal(x, y) or (p is not None and _uninitialised(first[p]))
                           for x, y, p in zip(a.inputs, b.inputs, a.producers, strict=True))
        outputs_equal = all(_equal(x, y) for x, y in zip(a.outputs.values(),
                                                            b.outputs.values(), strict=True))
        if inputs_equal and not outputs_equal:
            found.append(b)
    return found


def run_to_run_spreads(first: list[Step], again: list[Step]) -> dict[int, float]:
    """Per step whose outputs differ in ``again``, the largest difference in the forward metric,
    the runs paired step by step up to where the code took another path."""
    metric = tolerance.kind_tolerance("forward").metric
    spreads = {}
    for a, b in zip(first, again, strict=False):
        if a.name != b.name:
            break
        if _uninitialised(a) or all(_equal(x, y) for x, y in zip(
                a.outputs.values(), b.outputs.values(), strict=False)):
            continue
        spreads[a.index] = max((_spread(x, y, metric) for x, y in zip(
            a.outputs.values(), b.outputs.values(), strict=False)), default=0.0)
    return spreads


def _spread(x: torch.Tensor | Sketch, y: torch.Tensor | Sketch, metric: tolerance.Metric
            ) -> float:
    if x.shape != y.shape or not x.is_floating_point():
        return 0.0
    if isinstance(x, Sketch) or isinstance(y, Sketch):  # big: as its sketch is judged
        sketched = x if isinstance(x, Sketch) else y
        x, y = sketching.like(sketched, x), sketching.like(sketched, y)
        slices = tolerance.error(x.slices, y.slices, "max_abs") if x.slices.numel() else 0.0
        return max(sketching.error_estimate(x, y), slices)
    usable = x.isfinite() & y.isfinite()
    return tolerance.error(x[usable], y[usable], metric)


def _uninitialised(step: Step) -> bool:
    return "empty" in step.op


def _equal(x: torch.Tensor | Sketch, y: torch.Tensor | Sketch) -> bool:
    if isinstance(x, Sketch) or isinstance(y, Sketch):  # a big output: its sketch
        sketched = x if isinstance(x, Sketch) else y
        return sketching.like(sketched, x).same_values(sketching.like(sketched, y))
    return x.shape == y.shape and x.dtype == y.dtype and bool(
        torch.equal(x, y) or (x.is_floating_point() and torch.equal(x.isnan(), y.isnan())
                              and torch.equal(x.nan_to_num(), y.nan_to_num())))


def _where(step: Step) -> str:
    if not step.stack:
        return "no source line of user code"
    frame = step.stack[0]
    return f'{frame} "{frame.text}"'


def _as_call(inputs: Inputs) -> CallArgs:
    if isinstance(inputs, dict):
        return CallArgs((), dict(inputs))
    if isinstance(inputs, tuple):
        return CallArgs(inputs, {})
    return CallArgs((inputs,), {})


