"""The one rounds loop of every part, and the arithmetic of its times.

Method, chosen to survive noisy shared machines: every contender is warmed up, then measured in
rounds; in each round every contender runs once, in an order that rotates from round to round,
so slow drift (other jobs, clocks, heat) hits all of them alike. Times are medians over the
rounds and ratios are medians of the per-round ratios, reported beside the absolute numbers.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any


class Progress:
    """Progress callbacks; the CLI passes one that draws a bar. The default draws nothing."""

    def start(self, part: str, total: int) -> None:
        """A part begins that will call :meth:`advance` ``total`` times.

        Args:
            part: the part's name.
            total: its units of work.
        """

    def advance(self, description: str) -> None:
        """One unit of work is done.

        Args:
            description: what runs now.
        """


def interleaved(names: list[str], measure: Callable[[str], float | None], rounds: int,
                warmup: int, progress: Progress, label: str) -> dict[str, list[float]]:
    """Time contenders in interleaved rounds, so drift and load hit all of them alike.

    ``warmup`` unmeasured runs of every contender come first, then ``rounds`` rounds in which
    each runs once, in :func:`rotated` order.

    Args:
        names: the contenders.
        measure: runs one and returns its seconds, or None when it could not run.
        rounds: the measured rounds.
        warmup: the unmeasured runs of each.
        progress: advanced ``len(names) * (warmup + rounds)`` times.
        label: what the progress says runs.

    Returns:
        The seconds per contender in round order (a None left out).
    """
    for step in range(warmup):
        for name in names:
            progress.advance(f"{label}: warm-up {step + 1}, {name}")
            measure(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in rotated(names, round_index):
            progress.advance(f"{label}: round {round_index + 1}/{rounds}, {name}")
            seconds = measure(name)
            if seconds is not None:
                times[name].append(seconds)
    return times


def rotated(items: list[str], round_index: int) -> list[str]:
    """``items`` starting at position ``round_index`` (mod len): each runs first in turn.

    Args:
        items: the contenders.
        round_index: the round.

    Returns:
        The rotated list.
    """
    if not items:
        return []
    shift = round_index % len(items)
    return items[shift:] + items[:shift]


def paired_ratio(reference: list[float], times: list[float]) -> float:
    """Median over rounds of ``reference[r] / times[r]``; pairing by round cancels drift.

    A ratio of two medians would keep the drift.

    Args:
        reference: the reference's seconds per round.
        times: the contender's, in the same rounds.

    Returns:
        The ratio: > 1 means faster than the reference.
    """
    return statistics.median(r / t for r, t in zip(reference, times, strict=True))


def spread(times: list[float]) -> float:
    """Interquartile range over the median: 0.05 means the middle half lies within 5%.

    Args:
        times: seconds per round.

    Returns:
        The relative spread.
    """
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(times)


def na_row(reason: str, **fields: object) -> dict[str, Any]:
    """A row that could not be measured, with the reason why.

    Args:
        reason: why, in one line.
        **fields: what the row measures (model, dtype, backend...).

    Returns:
        The row, its ``status`` ``n/a``.
    """
    return {**fields, "status": "n/a", "reason": reason}
