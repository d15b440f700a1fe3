"""The training study's section of docs/tolerance.md: false alarms of the legitimate refactors
with their confidence bound, and the smallest planted change caught, per dtype and horizon."""

from __future__ import annotations

import datetime
import textwrap

from torchparity import tolerance
from torchparity.bench.host import describe_machine
from torchparity.calibration.sections import MarkedSection
from torchparity.calibration.training import JudgedRun, TrainingResults
from torchparity.calibration.training_models import REFACTORS, SCALED_BUGS

BEGIN = "<!-- training study: written by `torchparity calibrate --training` -->"
END = "<!-- end of the training study -->"
#: docs/tolerance.md's section of this study: the other studies' runs keep it.
SECTION = MarkedSection(BEGIN, END)


def training_section(results: TrainingResults, *, command: str) -> str:
    """The markdown section: what was run, both tables, the false alarms found, the command,
    the time and the machine with its load."""
    settings = results.settings
    seeds = ", ".join(f"{n} in {dtype}" for dtype, n in settings.seeds.items())
    steps = " and ".join(str(h) for h in settings.horizons)
    band = tolerance.KINDS["trajectory_band"]
    intro = _paragraph(
        "`torchparity train --model` judges a user's training run against the noise band of "
        f"a rounding-only ensemble (the plain run, {tolerance.BAND_REROUNDINGS} runs on "
        "weights moved by one rounding, the other instruction sets): at step n a quantity may "
        f"differ from the float64 run by {band.fudge:g} times the band, pooled over "
        f"{band.pool_steps} steps either side, plus {band.floor_ulps:g} ulps. Measured on the "
        "user-style LM (`torchparity.calibration.training_models`, the model of "
        "`tests/train/user_lm.py`), its weights and data drawn from each seed "
        f"({seeds}): per seed and dtype the golden and band are stored once for "
        f"{settings.steps} steps, and every run is judged over its first {steps} steps as "
        "`--check --steps N` judges it.")
    false_alarms = _paragraph(
        "*False alarms*: each refactor below changes rounding only (in float64 it trains the "
        "original's trajectory, to the float32 rounding of the recipe's cross-entropy of "
        "`.float()` logits); a diverged verdict is a false alarm. The bound is the "
        "one-sided 95% Clopper-Pearson bound of the rate (with no alarm, 1 - 0.05^(1/checks), "
        "about 3 / checks); a cell gives the alarms and the most of its budget a check used.")
    detection = _paragraph(
        "*Detection*: each bug is planted at strength eps = 1, 0.3, 0.1, 0.03, ... (largest "
        "first, until one passes at every horizon). Per seed, the smallest eps caught with "
        "every larger one caught too; the table gives the largest of these over the seeds "
        "(every seed catches from there up) and the smallest (the luckiest seed).")
    return f"""{BEGIN}
## Training: the noise band's false alarms and detection

{intro}

{false_alarms}

{_false_alarm_table(results)}

{_refactor_table(results)}

{_alarms(results)}

{detection}

{_detection_table(results)}

Command: `{command}`; {results.seconds / 60:.1f} minutes, {_today()}.
Machine: {describe_machine(results.machine)}; niceness {results.machine.get("niceness")}.
{END}
"""


def _columns(results: TrainingResults) -> list[tuple[str, int]]:
    return [(dtype, h) for dtype in results.settings.seeds for h in results.settings.horizons]


def _false_alarm_table(results: TrainingResults) -> str:
    lines = ["| dtype | steps | false alarms (rate, 95% bound) | most of a budget used |",
             "| --- | --- | --- | --- |"]
    for dtype, horizon in _columns(results):
        lines.append(f"| {dtype} | {horizon} | {results.false_alarms(dtype, horizon)} | "
                     f"{results.largest_share(dtype, horizon):.0%} |")
    return "\n".join(lines)


def _refactor_table(results: TrainingResults) -> str:
    columns = _columns(results)
    lines = ["| refactor | what it is | " + " | ".join(f"{d} {h} steps" for d, h in columns)
             + " |", "| --- " * (2 + len(columns)) + "|"]
    for refactor in results.settings.refactors:
        cells = []
        for dtype, horizon in columns:
            rate = results.false_alarms(dtype, horizon, refactor)
            share = results.largest_share(dtype, horizon, refactor)
            cells.append(f"{rate.events} of {rate.trials}, {share:.0%}")
        lines.append(f"| {refactor} | {REFACTORS[refactor]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _alarms(results: TrainingResults) -> str:
    alarms = [v for v in results.verdicts if v.eps is None and v.diverged]
    if not alarms:
        return "No refactor diverged."
    worst = max(v.headroom for v in alarms)
    fudge = tolerance.KINDS["trajectory_band"].fudge
    lines = [f"- {_where(v)}" for v in alarms]
    return ("The false alarms (a budget used beyond 100% is the error over the budget):\n\n"
            + "\n".join(lines) + f"\n\nA fudge of {fudge * worst:.2g} (now {fudge:g}) would "
            "have passed them all, at the cost of as much sensitivity.")


def _where(v: JudgedRun) -> str:
    return (f"{v.variant}, seed {v.seed}, {v.dtype}, {v.horizon} steps: step {v.first_step}, "
            f"{v.first_quantity}, {v.headroom:.0%} of the budget")


def _detection_table(results: TrainingResults) -> str:
    lines = ["| bug | what eps does | dtype | steps | every seed from eps | best seed from eps |",
             "| --- | --- | --- | --- | --- | --- |"]
    for bug in results.settings.bugs:
        for dtype, horizon in _columns(results):
            found = results.thresholds(bug, dtype, horizon)
            every = None if None in found else max(found, default=None)
            best = min((t for t in found if t is not None), default=None)
            lines.append(f"| {bug} | {SCALED_BUGS[bug]} | {dtype} | {horizon} | "
                         f"{_eps(every, results)} | {_eps(best, results)} |")
    return "\n".join(lines)


def _eps(eps: float | None, results: TrainingResults) -> str:
    if eps is None:
        return f"missed at {results.settings.strengths[0]:g}"
    return f"<= {eps:g}" if eps == min(results.settings.strengths) else f"{eps:g}"


def _paragraph(text: str) -> str:
    return textwrap.fill(text, width=96, break_on_hyphens=False)


def _today() -> str:
    return datetime.datetime.now(datetime.UTC).date().isoformat()
