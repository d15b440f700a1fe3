"""A rate measured by counting, with how high it could be: the one-sided Clopper-Pearson bound
(no false alarm in ``n`` checks makes a rate above ``1 - 0.05 ** (1 / n)``, about 3 / n,
unlikely at 95%; exact for any count)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Rate:
    """``events`` in ``trials`` (false alarms in checks), and the upper bound of its rate."""

    events: int
    trials: int
    confidence: float = 0.95

    @property
    def value(self) -> float:
        return self.events / self.trials if self.trials else math.nan

    @property
    def upper(self) -> float:
        """The one-sided Clopper-Pearson upper bound at :attr:`confidence` (NaN untried)."""
        return clopper_pearson_upper(self.events, self.trials, self.confidence)

    def __str__(self) -> str:
        """``0 of 50 (0%, <= 5.8% at 95%)``."""
        if not self.trials:
            return "none checked"
        return (f"{self.events} of {self.trials} ({_percent(self.value)}, <= "
                f"{_percent(self.upper)} at {self.confidence:.0%})")


def clopper_pearson_upper(events: int, trials: int, confidence: float = 0.95) -> float:
    """The one-sided Clopper-Pearson upper confidence bound of a rate.

    Args:
        events: how many of the trials the event happened in.
        trials: how many trials were counted (0: NaN).
        confidence: the confidence the bound holds at.

    Returns:
        The ``p`` with ``P(X <= events) = 1 - confidence`` for ``X ~ Binomial(trials, p)``.
    """
    if not trials:
        return math.nan
    if events >= trials:
        return 1.0
    alpha = 1 - confidence
    low, high = events / trials, 1.0
    for _ in range(60):  # bisection: P(X <= events) falls as p rises
        middle = (low + high) / 2
        low, high = (middle, high) if _at_most(events, trials, middle) > alpha else (low, middle)
    return high


def _at_most(events: int, trials: int, p: float) -> float:
    """``P(X <= events)`` for ``X ~ Binomial(trials, p)``, summed in logs (no overflow)."""
    if p <= 0:
        return 1.0
    if p >= 1:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    return sum(math.exp(math.lgamma(trials + 1) - math.lgamma(k + 1) - math.lgamma(trials - k + 1)
                        + k * log_p + (trials - k) * log_q)
               for k in range(events + 1))


def _percent(x: float) -> str:
    return f"{100 * x:.2g}%" if x < 0.1 else f"{x:.0%}"
