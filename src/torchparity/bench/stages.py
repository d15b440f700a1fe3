"""Where a diagnosis's time goes: the phases it reports, summed into the bench's stages.

A diagnosis times each of its phases (``report.meta.seconds``, see
:mod:`torchparity.diagnosis.core.progress`); the bench adds the time to render the report and, for a
decoding, the ``record`` of A's side, and sums them into :data:`STAGES`. A phase goes to the
first stage whose words it contains; one that no stage names is a run (A's, the golden's, B's,
aligning the modules, attribution runs). What the timed call spent outside every phase
(checking the models and options, opening and checking a trace, casting) is ``other``, so the
stages add up to the call.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchparity.diagnosis.pipelines.decoding import DecodeReport
    from torchparity.diagnosis.reports.diagnosis import DiagnosisReport

RUNS = "runs"
#: Each stage besides the runs, in the table's order, and the words that name its phases.
STAGES = {
    "judging": ("judging",),
    "replays": ("replays", "where the first divergence enters", "again, every module captured"),
    "float64 check": ("in float64",),
    "op drill-down": ("the module's ops",),
}
OTHER = "other"
REPORT = "report"


def stage_seconds(report: DiagnosisReport | DecodeReport, call_s: float, before: float = 0.0
                  ) -> dict[str, float]:
    """Seconds of one diagnosis by stage, and of rendering its report.

    Judging while B runs is timed inside B's run, so it is taken out of the runs.

    Args:
        report: the diagnosis, whose metadata times its phases.
        call_s: the seconds the timed call took.
        before: time the call spent ahead of the diagnosis on its runs (a decoding's
            ``record`` of A and its golden).

    Returns:
        The runs, :data:`STAGES`, the rest of ``call_s`` (``other``), then rendering the report
        (table, JSON, HTML: what the command adds).
    """
    stages = {RUNS: before, **dict.fromkeys(STAGES, 0.0)}
    for phase, seconds in report.meta.seconds.items():
        stage = next((s for s, words in STAGES.items() if any(w in phase for w in words)), RUNS)
        stages[stage] += seconds
    stages[RUNS] -= stages["judging"]
    stages[OTHER] = call_s - sum(stages.values())
    start = time.perf_counter()
    report.render(width=80), report.to_json(), report.to_html()
    stages[REPORT] = time.perf_counter() - start
    return stages


def per_plain(stages: dict[str, float], plain_s: float) -> dict[str, float]:
    """``stages`` as multiples of the plain run's seconds.

    Args:
        stages: seconds by stage.
        plain_s: a plain run's seconds.

    Returns:
        The multiples by stage.
    """
    return {stage: seconds / plain_s for stage, seconds in stages.items()}
