"""Where a diagnosis's time goes: its timed phases summed into the bench's :data:`STAGES`.

A phase goes to the first stage whose words it contains, else to the runs; time outside every
phase (checking, casting) is ``other``, so the stages add up to the call.
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
    """Seconds of one diagnosis by stage, ``other``, and rendering its report."""
    # before: a decoding's record of A and its golden
    stages = {RUNS: before, **dict.fromkeys(STAGES, 0.0)}
    for phase, seconds in report.meta.seconds.items():
        stage = next((s for s, words in STAGES.items() if any(w in phase for w in words)), RUNS)
        stages[stage] += seconds
    # judging while B runs is timed inside B's run
    stages[RUNS] -= stages["judging"]
    stages[OTHER] = call_s - sum(stages.values())
    start = time.perf_counter()
    report.render(width=80), report.to_json(), report.to_html()
    stages[REPORT] = time.perf_counter() - start
    return stages


def per_plain(stages: dict[str, float], plain_s: float) -> dict[str, float]:
    """``stages`` as multiples of the plain run's seconds."""
    return {stage: seconds / plain_s for stage, seconds in stages.items()}
