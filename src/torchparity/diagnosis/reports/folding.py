"""Which rows of a deep model's report a terminal shows, and which it folds into one line.

A deep model's report has hundreds of rows (every module of every layer); a CI log reader needs
the few that matter: where the divergence is first seen, where it enters, its neighbours. The
rows come in groups (a layer and the modules inside it, see the report's layer groups); a run
of consecutive groups that hold no row that matters and show the same verdicts folds into one
line, and inside a group that holds one, the rows away from it fold likewise. JSON and HTML
keep every row.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass

#: Reports with more rows than this are folded on the terminal.
FOLD_ABOVE = 40


@dataclass(frozen=True)
class Fold:
    """Rows shown as one line: ``rows`` (indices, in order) span whole groups, the last row
    of each in ``ends``, or part of one group (``ends`` empty) whose last row is ``owner``."""

    rows: tuple[int, ...]
    ends: tuple[int, ...] = ()
    owner: int | None = None


def folded(groups: list[list[int]], important: Collection[int],
           signature: Callable[[list[int]], Hashable]) -> list[int | Fold]:
    """The terminal's lines: a row index, or a :class:`Fold` of rows.

    A group holding an ``important`` row shows it, the rows next to it and the group's last
    row (the layer itself); the rows between them fold. Consecutive groups holding none fold
    into one line as long as ``signature`` (of a group's rows) stays the same. A fold of one
    row is shown as the row."""
    lines: list[int | Fold] = []
    run: list[list[int]] = []
    run_signature: Hashable = None

    def flush() -> None:
        if run:
            rows = tuple(i for group in run for i in group)
            ends = tuple(group[-1] for group in run)
            lines.append(rows[0] if len(rows) == 1 else Fold(rows, ends))
            run.clear()

    for group in groups:
        if any(i in important for i in group):
            flush()
            lines += _inside(group, important)
            continue
        group_signature = signature(group)
        if run and group_signature != run_signature:
            flush()
        run.append(group)
        run_signature = group_signature
    flush()
    return lines


def _inside(group: list[int], important: Collection[int]) -> list[int | Fold]:
    shown = {group[-1]}
    for position, index in enumerate(group):
        if index in important:
            shown.update(group[max(position - 1, 0):position + 2])
    lines: list[int | Fold] = []
    hidden: list[int] = []
    for index in group:
        if index in shown:
            if hidden:
                lines.append(hidden[0] if len(hidden) == 1
                             else Fold(tuple(hidden), owner=group[-1]))
                hidden = []
            lines.append(index)
        else:
            hidden.append(index)
    return lines
