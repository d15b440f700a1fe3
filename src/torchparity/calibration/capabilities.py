"""The calibration under each instruction set this CPU offers: the same draws, one process per
capability (torch reads ``ATEN_CPU_CAPABILITY`` once, at start-up), and the false alarms and
detection rates of each side by side (``torchparity calibrate --capabilities``)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchparity import machine
from torchparity.calibration.problems import GOAL_MULTIPLE
from torchparity.calibration.sections import MarkedSection
from torchparity.errors import UsageError

BEGIN = "<!-- per instruction set: written by `torchparity calibrate --capabilities` -->"
END = "<!-- end of the study per instruction set -->"


@dataclass(frozen=True)
class CapabilityRow:
    """What one capability's run measured, over the fp32 candidates for detection."""

    capability: str
    draws: int
    false_alarms: int
    judged: int  # legitimate candidates judged (backend x dtype x kind x draw)
    caught: dict[str, tuple[int, int]]  # kind -> (caught, changes) at the kind's goal multiple
    visible: tuple[int, int]  # (caught, visible) planted bugs, fp32
    seconds: float


def calibrate_each(argv: list[str], capabilities: list[str],
                   on_done: Callable[[str], None] = lambda capability: None
                   ) -> list[CapabilityRow]:
    """Run ``torchparity calibrate ARGV`` under each of ``capabilities`` in its own process
    and return what each measured. A run that fails to start ends the study with its message."""
    rows = []
    for capability in capabilities:
        with tempfile.TemporaryDirectory() as folder:
            out = Path(folder) / "results.json"
            done = subprocess.run(
                [sys.executable, "-m", "torchparity", "calibrate", *argv, "--json", str(out)],
                env=machine.environment(capability), capture_output=True, text=True)
            if not out.exists():  # a usage or unexpected error: the calibration did not run
                last = (done.stderr.strip().splitlines() or ["no message"])[-1]
                raise UsageError(f"calibrate under ATEN_CPU_CAPABILITY={capability} failed: "
                                 f"{last}")
            results = json.loads(out.read_text())
        ran = results["machine"]["cpu_capability"]
        if ran != capability:
            raise UsageError(f"ATEN_CPU_CAPABILITY={capability} ran {ran} kernels: this CPU "
                             f"offers {', '.join(machine.capabilities())}")
        rows.append(_row(capability, results))
        on_done(capability)
    return rows


def _row(capability: str, results: dict[str, Any]) -> CapabilityRow:
    caught: dict[str, tuple[int, int]] = {}
    for curve in results["detection_curve"]:
        if curve["dtype"] != "fp32":
            continue
        at_goal = curve["counts"][str(GOAL_MULTIPLE[curve["kind"]])]
        before = caught.get(curve["kind"], (0, 0))
        caught[curve["kind"]] = (before[0] + at_goal["caught"], before[1] + at_goal["changes"])
    fp32 = [d for d in results["detection"] if d["dtype"] == "fp32"]
    return CapabilityRow(
        capability=capability,
        draws=results["draws"],
        false_alarms=sum(len(f["failures"]) for f in results["false_alarms"]),
        judged=sum(f["draws"] for f in results["false_alarms"]),
        caught=caught,
        visible=(sum(d["caught_visible"] for d in fp32), sum(d["visible"] for d in fp32)),
        seconds=results["seconds"],
    )


def _rate(caught: int, total: int) -> str:
    return f"{caught} of {total} ({caught / total:.1%})" if total else "none"


def capabilities_section(rows: list[CapabilityRow], *, command: str) -> str:
    """The markdown section of docs/tolerance.md: one row per capability."""
    kinds = sorted({kind for row in rows for kind in row.caught})
    header = ("| capability | false alarms | "
              + " | ".join(f"fp32 {k} caught at >= {GOAL_MULTIPLE[k]}x" for k in kinds)
              + " | fp32 visible bugs caught | minutes |")
    lines = [header, "| --- " * (4 + len(kinds)) + "|"]
    for row in rows:
        lines.append(f"| {row.capability} | {row.false_alarms} of {row.judged} | "
                     + " | ".join(_rate(*row.caught.get(k, (0, 0))) for k in kinds)
                     + f" | {_rate(*row.visible)} | {row.seconds / 60:.1f} |")
    draws = rows[0].draws if rows else 0
    return f"""{BEGIN}
## Per instruction set: the same draws on each

torch chooses its CPU kernels by instruction set, and each rounds in its own way: the same
draws, under each instruction set this CPU offers (`ATEN_CPU_CAPABILITY`, one process each).
False alarms are legitimate candidates that failed (backend x dtype x kind x draw); detection
is that of the planted changes in fp32 whose float64 effect reaches the goal multiple of the
baseline's error, and of the visible planted bugs.

{chr(10).join(lines)}

Command: `{command}`; {draws} draws of each family per instruction set.
{END}
"""


#: docs/tolerance.md's section of this study: a main run keeps it.
SECTION = MarkedSection(BEGIN, END)
