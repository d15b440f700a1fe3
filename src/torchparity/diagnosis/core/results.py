"""What the stages of a diagnosis hand each other and the reports show: rows and results."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from torchparity.comparison.structure import format_shape
from torchparity.comparison.tensor import json_safe

if TYPE_CHECKING:
    from torchparity.diagnosis.core.align import Match

__all__ = ["Bounded", "DrilledOps", "Entry", "Mismatch", "NotCompared", "Result", "Row"]

#: How a row's note begins when its module could not be replayed: its local error is unknown.
UNKNOWN_LOCAL = "local error unknown"


class DrilledOps(Protocol):
    """What the reports read of a call drilled down to its ops (the ops stage's ``OpReport``)."""

    #: on a backward pass, the forward divergence its gradient follows from (a
    #: :class:`~torchparity.diagnosis.stages.ops.ForwardCause`), or None
    follows: Any

    def sentence(self) -> str: ...

    def table_lines(self, width: int) -> list[tuple[str, str | None]]: ...

    def to_html(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


class Result(Protocol):
    """What a row holds per comparison: a ``Comparison``, a :class:`Mismatch` and the like."""

    kind: str

    @property
    def ok(self) -> bool: ...

    @property
    def verdict(self) -> str: ...

    def explain(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass
class Mismatch:
    """A comparison the sides' differing structure or shape prevents; it counts as diverged."""

    kind: str
    reason: str
    tensors: list = field(default_factory=list)

    ok = False
    verdict = "diverged"

    def explain(self) -> str:
        return f"diverged: outputs differ in structure: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "ok": False, "kind": self.kind, "mismatch": self.reason}


@dataclass
class NotCompared:
    """A comparison with nothing alike on both sides: no evidence either way, and said so."""

    kind: str
    reason: str
    tensors: list = field(default_factory=list)
    structure: tuple = ()
    shapes: tuple = ()

    ok = True  # nothing breaks a budget, and nothing is claimed to be within one
    verdict = "not compared"

    def explain(self) -> str:
        return f"not compared: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "ok": None, "kind": self.kind,
                "not_compared": self.reason}


@dataclass(frozen=True)
class Entry:
    """Where a divergence enters a module: the argument or state it comes through, and how."""

    module: str
    argument: str
    detail: str
    via: str = "argument"  # "state": what the module keeps (a cache on itself); "code": none


@dataclass
class Bounded:
    """A ``within`` or ``identical`` verdict from a bound: each error is at most ``headroom``."""

    kind: str
    verdict: str
    error: float  # the largest error, in the kind's metric
    headroom: float  # an upper bound of the largest share of a budget used
    tensors: list = field(default_factory=list)
    structure: tuple = ()

    ok = True

    def explain(self) -> str:
        if self.verdict == "identical":
            return "identical: bit-equal to A's own output."
        return (f"within: every tensor's error is at most {self.headroom:.3g} of its budget "
                "(full metrics are computed for diverged modules, or with local='all').")

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "ok": True, "kind": self.kind, "error": self.error,
                "headroom_at_most": self.headroom}


def worst_error(result: Result | None) -> float | None:
    """The largest error (in the kind's metric) over the result's tensors; inf for a mismatch."""
    return _largest(result, "error")


def headroom(result: Result | None) -> float | None:
    """The largest share of its budget any tensor used (>1: diverged); a bound's own value."""
    return _largest(result, "headroom")


def _largest(result: Result | None, metric: str) -> float | None:
    """The largest ``metric`` of the result's tensors; inf for a mismatch, None for nothing."""
    if result is None or isinstance(result, NotCompared):
        return None
    if isinstance(result, Mismatch) or getattr(result, "shapes", ()):
        return math.inf
    if isinstance(result, Bounded):
        return getattr(result, metric)
    return max((getattr(t, metric) for t in result.tensors), default=0.0)


@dataclass
class Row:
    """One aligned module (or fused group) of the diagnosis."""

    module: str  # B's qualified name, with ``#k`` for its k-th later call
    a_module: str
    how: str  # "name", "name_map", "order" or "fused"
    module_type: str
    depth: int
    start: int
    local: Result | None = None  # B's module fed A's recorded inputs, against the golden's
    propagated: Result | None = None  # B's output in its own run, against the golden's run
    grad_local: Result | None = None  # the same for gradients
    grad_propagated: Result | None = None
    inputs: Result | None = None  # decoding only: the module's inputs, as ``propagated``
    entry: Entry | None = None  # on a first divergence containing others: where it enters
    notes: list[str] = field(default_factory=list)
    ops: DrilledOps | None = None  # the op drill-down of this call, when it was drilled
    grad_ops: DrilledOps | None = None  # the same of its backward pass, on the first
    # gradient divergence

    @property
    def structure(self) -> tuple:
        """Outputs A and B hold in different structure: judged apart, never a divergence."""
        return self._differences("structure")

    @property
    def shapes(self) -> tuple:
        """Outputs A and B both hold in different shapes: a divergence of its own."""
        return self._differences("shapes")

    def _differences(self, kind: str) -> tuple:
        """The differences of one kind the propagated result holds, else the local one."""
        for result in (self.propagated, self.local):
            if result is not None and getattr(result, kind, ()):
                return tuple(getattr(result, kind))
        return ()

    @property
    def amplification(self) -> float | None:
        """Propagated over local error: about 1 at the source, large where it only carries."""
        propagated, local = worst_error(self.propagated), worst_error(self.local)
        if propagated is None or local is None or math.isinf(propagated):
            return None
        if local == 0:
            return None if propagated == 0 else math.inf
        return propagated / local

    def to_dict(self) -> dict[str, Any]:
        def dump(result: Result | None) -> dict[str, Any] | None:
            return None if result is None else result.to_dict()

        return json_safe({
            "module": self.module, "a_module": self.a_module, "how": self.how,
            "type": self.module_type, "depth": self.depth,
            "inputs": dump(self.inputs),
            "local": dump(self.local), "propagated": dump(self.propagated),
            "amplification": self.amplification,
            "grad_local": dump(self.grad_local), "grad_propagated": dump(self.grad_propagated),
            "structure": [{"path": d.path, "a": d.golden, "b": d.candidate}
                          for d in self.structure],
            "shapes": [{"path": d.path, "a": list(d.golden), "b": list(d.candidate)}
                       for d in self.shapes],
            "entry": None if self.entry is None else {
                "module": self.entry.module, "argument": self.entry.argument,
                "detail": self.entry.detail, "via": self.entry.via},
            "notes": self.notes,
            "ops": None if self.ops is None else self.ops.to_dict(),
            "grad_ops": None if self.grad_ops is None else self.grad_ops.to_dict(),
        })


# --------------------------------------------------------------------------------------------
# cells: a result's text, the same in the terminal, the HTML and CI


def module_label(module: str) -> str:
    return module or "(model)"


def structure_difference(difference: Any) -> str:
    """``output.1: A has Tensor(2, 4, 8, 8) float32, B has None``."""
    def side(what: str) -> str:
        return "nothing there" if what == "missing" else what

    return f"{difference.path}: A has {side(difference.golden)}, B has {side(difference.candidate)}"


def shape_difference(difference: Any) -> str:
    """``shape differs at output.1: (1, 2, 1, 11) vs (1, 2, 1, 12) (A vs B)``."""
    return (f"shape differs at {difference.path}: {format_shape(difference.golden)} vs "
            f"{format_shape(difference.candidate)} (A vs B)")


def unknown_local(row: Row) -> bool:
    """Whether the row's module could not be replayed, so its local error is unknown."""
    return row.local is None and any(note.startswith(UNKNOWN_LOCAL) for note in row.notes)


def diverged(row: Row) -> bool:
    results = (row.local, row.propagated, row.grad_local, row.grad_propagated)
    return any(result is not None and not result.ok for result in results)


def ratio(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.2g}"


def share_cell(result: Result | None) -> str:
    if result is None:
        return "-"
    if isinstance(result, NotCompared):
        return "n/c"
    if result.verdict == "identical":
        return "="
    if getattr(result, "shapes", ()):
        return "X shape"
    share = _compact(headroom(result))
    if isinstance(result, Bounded):
        return f"<{share}" if not share.startswith("<") else share
    return share if result.ok else f"X {share}"


def _compact(share: float | None) -> str:
    """A share of the budget in at most 5 characters: .14, <.01, 5.7, 290, 3e+05, inf."""
    if share is None:
        return "-"
    if math.isinf(share) or math.isnan(share):
        return str(share)
    if share < 0.01:
        return "<.01"
    if share < 1:
        return f"{share:.2f}".removeprefix("0")
    return f"{share:.3g}" if share < 1000 else f"{share:.0e}"


def new_row(match: Match) -> Row:
    """An empty row for an aligned module (named after B's first call of it)."""
    first_b = min(match.b, key=lambda c: c.start)
    return Row(module=match.b_name, a_module=match.a_name, how=match.how,
               module_type="+".join(c.module_type for c in match.b), depth=first_b.depth,
               start=first_b.start)
