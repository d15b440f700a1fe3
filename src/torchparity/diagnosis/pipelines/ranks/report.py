"""What a diagnosis across ranks found, said once by rank 0: the first module whose output,
then gradients, leave their budget on some rank or differ between ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchparity.diagnosis.core.results import Result, module_label
from torchparity.text import wrap

LOCAL_NOT_COMPUTED = "Local errors are not computed across ranks (--nproc)."


@dataclass
class RankDivergence:
    """The first module whose output (or gradient) leaves its budget, where, and its verdict."""

    module: str
    module_type: str
    ranks: list[int]
    result: Result

    def lines(self, what: str, nproc: int) -> list[str]:
        ranks = ", ".join(map(str, self.ranks))
        return [*wrap(f"{what}: {module_label(self.module)} ({self.module_type}) on "
                      f"rank{'s' if len(self.ranks) > 1 else ''} {ranks} of {nproc}"),
                *wrap(f"  {self.result.explain()}")]

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "module_type": self.module_type, "ranks": self.ranks,
                "result": self.result.to_dict()}


@dataclass
class RanksDiffer:
    """A verdict: the copies of a module's output or gradients every rank computes differ."""

    ranks: list[int]
    difference: float
    what: str = "output"

    ok = False
    verdict = "differs between ranks"

    def explain(self) -> str:
        return (f"differs between ranks: the {self.what} of rank(s) "
                f"{', '.join(map(str, self.ranks))} differs from rank 0's by up to "
                f"{self.difference:.3g} (max-abs), though every rank runs the same replicated "
                "computation on the same inputs")

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "ok": False, "ranks": self.ranks,
                "max_abs_difference": self.difference}


@dataclass
class RankReport:
    """What rank 0 found against ``against``: the first divergence over ``judged`` modules, then
    the first gradient divergence over ``grads_judged`` (None: not judged, ``grad_note`` why)."""

    against: str
    nproc: int
    judged: int
    first_divergence: RankDivergence | None
    grads_judged: int | None = None
    first_grad_divergence: RankDivergence | None = None
    grad_note: str = ""

    @property
    def exit_status(self) -> int:
        return 0 if self.first_divergence is None and self.first_grad_divergence is None else 1

    def lines(self) -> list[str]:
        first, grad = self.first_divergence, self.first_grad_divergence
        if first is None:
            said = wrap(f"No module diverges on any of {self.nproc} ranks ({self.judged} "
                        f"modules judged against {self.against}).")
        else:
            said = first.lines("First divergence", self.nproc)
        if self.grads_judged is None:
            said += wrap(self.grad_note)
        elif grad is not None:
            said += grad.lines("First gradient divergence", self.nproc)
        else:
            said += wrap(f"No parameter gradient diverges on any rank ({self.grads_judged} "
                         "modules' gradients judged, each rank its own shards).")
        return [*said, LOCAL_NOT_COMPUTED]

    def to_dict(self) -> dict[str, Any]:
        first, grad = self.first_divergence, self.first_grad_divergence
        return {"against": self.against, "nproc": self.nproc, "judged_modules": self.judged,
                "first_divergence": None if first is None else first.to_dict(),
                "judged_gradients": self.grads_judged,
                "first_grad_divergence": None if grad is None else grad.to_dict(),
                "gradients": self.grad_note or None,
                "local_errors": "not computed under --nproc"}
