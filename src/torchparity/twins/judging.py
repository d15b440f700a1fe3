"""The verdict on a candidate: the comparison engine applied to outputs and gradients.

The candidate (new, in the dtype) is compared with the golden (old, in float64) under the budget
a baseline (old, in the dtype) earns, its own rounding measured by a rerun; it passes within the
budget of one of the baselines (as written, and on the candidate's backend).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchparity.comparison import Comparison, compare
from torchparity.subject.trees import PyTree
from torchparity.text import wrapped
from torchparity.twins.running import Run


@dataclass
class TwinVerdict:
    """The forward comparison, the gradients' (None without a backward pass) and what ran."""

    forward: Comparison
    grads: Comparison | None
    dtype: str
    backend: str | None

    @property
    def ok(self) -> bool:
        return self.forward.ok and (self.grads is None or self.grads.ok)

    def __bool__(self) -> bool:
        return self.ok

    def explain(self) -> str:
        """What was compared and each part's explanation, in lines of at most 80 columns."""
        where = f"{self.dtype}" + (f" on {self.backend}" if self.backend else "")
        parts = [f"twins in {where}: {'pass' if self.ok else 'FAIL'}",
                 "outputs: " + self.forward.explain()]
        if self.grads is not None:
            parts.append("gradients: " + self.grads.explain())
        return "\n".join(wrapped(part) for part in parts)


def judge_twins(candidate: Run, golden: Run, baselines: list[Run], rerun: Run, *,
          padding: torch.Tensor | None, dtype: str, backend: str | None) -> TwinVerdict:
    """The verdict: outputs under the forward tolerance, gradients under the gradient one."""
    forward = _best(candidate.outputs, golden.outputs, [b.outputs for b in baselines],
                    rerun.outputs, "forward", padding)
    grads = None
    if candidate.grads is not None and golden.grads is not None:
        shared = _shared_grads(candidate.grads, golden.grads)
        grads = _best(shared(candidate.grads), shared(golden.grads),
                      [shared(b.grads) for b in baselines if b.grads is not None],
                      shared(rerun.grads), "grad", None)
    return TwinVerdict(forward, grads, dtype, backend)


def _best(candidate: PyTree, golden: PyTree, baselines: list[PyTree], rerun: PyTree,
          kind: str, padding: torch.Tensor | None) -> Comparison:
    """The first baseline's comparison that passes, else the first one's."""
    results = [compare(candidate, golden, baseline, kind, reruns=[rerun], padding=padding)
               for baseline in baselines]
    return next((result for result in results if result.ok), results[0])


def _shared_grads(a: dict, b: dict) -> Callable[[dict], dict]:
    """Gradients compared under the names both sides have (a map may leave some unnamed)."""
    names = {group: set(a[group]) & set(b[group]) for group in a}

    def select(grads: dict) -> dict:
        return {group: {n: g for n, g in grads[group].items() if n in names[group]}
                for group in grads}

    return select
