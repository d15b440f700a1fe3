"""The one rounds loop of every part, and the arithmetic of its times.

Every contender is warmed up, then run once per round in an order rotating between rounds, so
slow drift (other jobs, clocks, heat) hits all alike: times are medians over rounds, ratios
medians of per-round ratios.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any, TypeAlias

#: One row of the bench's JSON result: what one contender measured, by field.
Row: TypeAlias = dict[str, Any]
#: A JSON document of measurements: a bench result, a machine, a model's costs.
Document: TypeAlias = dict[str, Any]


class Progress:
    """Progress callbacks; the CLI passes one that draws a bar. The default draws nothing."""

    def start(self, part: str, total: int) -> None:
        """A part begins that will call :meth:`advance` ``total`` times."""

    def advance(self, description: str) -> None:
        """One unit of work (``description``: what runs now) is done."""


def interleaved(names: list[str], measure: Callable[[str], float | None], rounds: int,
                warmup: int, progress: Progress, label: str) -> dict[str, list[float]]:
    """The seconds per contender in round order: ``warmup`` runs, then ``rounds`` rotated rounds."""
    for step in range(warmup):
        for name in names:
            progress.advance(f"{label}: warm-up {step + 1}, {name}")
            measure(name)  # measure returns None where a contender could not run: left out
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in rotated(names, round_index):
            progress.advance(f"{label}: round {round_index + 1}/{rounds}, {name}")
            seconds = measure(name)
            if seconds is not None:
                times[name].append(seconds)
    return times


def rotated(items: list[str], round_index: int) -> list[str]:
    """``items`` starting at position ``round_index`` (mod len): each runs first in turn."""
    if not items:
        return []
    shift = round_index % len(items)
    return items[shift:] + items[:shift]


def paired_ratio(reference: list[float], times: list[float]) -> float:
    """Median over rounds of ``reference[r] / times[r]`` (> 1: faster than the reference)."""
    # pairing by round cancels drift, which a ratio of medians would keep
    return statistics.median(r / t for r, t in zip(reference, times, strict=True))


def spread(times: list[float]) -> float:
    """Interquartile range over the median: 0.05 means the middle half lies within 5%."""
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return (q3 - q1) / statistics.median(times)


def na_row(reason: str, **fields: object) -> Row:
    """A row that could not be measured, its ``status`` ``n/a``, with the reason why."""
    return {**fields, "status": "n/a", "reason": reason}
