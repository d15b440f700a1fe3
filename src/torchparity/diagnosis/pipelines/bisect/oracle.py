"""The bisection's oracle: one compiled cell of the check, judged as the check judges it.

A run passes when every output of the cell is within its budget against the float64 golden,
the eager ``manual`` backend in the same dtype the baseline (``golden.check_loop``), so only a
change of the math fails. A zoo case is judged against its committed goldens; a user's model
against float64 goldens made from its factory at the start, in the bisection's own folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torchparity.errors import TorchParityError
from torchparity.golden.cases import check_case
from torchparity.golden.cells import Cell, CheckResult
from torchparity.golden.model_check import check_subject
from torchparity.golden.store import GoldenStore, default_golden_dir
from torchparity.golden.user_models import model_store, write_goldens
from torchparity.reference import zoo
from torchparity.subject import Subject
from torchparity.threads import single_thread


class NotBisected(TorchParityError):
    """The cell diverges but cannot be bisected (the message says why, in one line)."""

    exit_status = 1


class Unstable(NotBisected):
    """The cell's verdict changed between two runs of the same compile: no bisection can
    rest on it."""


def is_case(entry: str) -> bool:
    """Whether ``entry`` names a zoo case rather than a factory (``file.py:name``)."""
    return ":" not in entry and entry in zoo.names()


def cell_checker(entry: str, cell: Cell, golden_root: Path
                 ) -> Callable[[], list[CheckResult]]:
    """A function that runs ``cell`` of ``entry`` (a zoo case or a factory) and returns its
    rows; a factory's goldens are written under ``golden_root`` first."""
    if is_case(entry):
        store, case = GoldenStore(default_golden_dir()), zoo.get(entry)
        return lambda: check_case(store, case, [cell])
    subject = Subject.load(entry)
    store = model_store(subject, golden_root)
    with single_thread():
        write_goldens(subject, store)
    return lambda: check_subject(subject, store, [cell])


def passed(rows: list[CheckResult]) -> bool:
    """Whether the cell passed: every output judged and within its budget (a cell that could
    not compile, its rows ``n/a``, has not passed)."""
    return bool(rows) and all(row.ok and row.verdict != "n/a" for row in rows)


def unrunnable(rows: list[CheckResult]) -> str | None:
    """Why the cell could not run at all (its first ``n/a`` row's reason), or None."""
    return next((row.reason or "n/a" for row in rows if row.verdict == "n/a"), None)


def verdict(check: Callable[[], list[CheckResult]], repeats: int
            ) -> tuple[bool, list[CheckResult]]:
    """The cell's verdict, the same in ``repeats`` runs (else :class:`Unstable`), and the
    rows of the last run."""
    outcomes = []
    for _ in range(repeats):
        with single_thread():
            rows = check()
        outcomes.append(passed(rows))
    if len(set(outcomes)) > 1:
        raise Unstable(f"the cell passed in {sum(outcomes)} of {repeats} runs of the same "
                       "compile: its kernels are not deterministic here, so no bisection can "
                       "rest on its verdict")
    return outcomes[0], rows
