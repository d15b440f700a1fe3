"""Part ``check``: the wall time of ``torchparity check``, run as a user runs it."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from torchparity.bench.rounds import Progress, na_row
from torchparity.bench.settings import Settings

CHECK_COMMAND = ("torchparity", "check")


def check_rows(settings: Settings, progress: Progress) -> list[dict[str, Any]]:
    """Wall and CPU seconds of ``torchparity check`` with no options, in its own process."""
    fields = {"command": " ".join(CHECK_COMMAND), "logical_cores": os.cpu_count()}
    if settings.quick:
        return [na_row("not measured: --quick does not time `torchparity check` (about a "
                       "minute); run without --quick", **fields)]
    progress.start("check", 1)
    progress.advance("torchparity check")
    src = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    start, cpu_start = time.perf_counter(), _children_cpu_s()
    done = subprocess.run([sys.executable, "-m", "torchparity.cli", *CHECK_COMMAND[1:]],
                          env=env, capture_output=True, text=True)
    seconds, cpu_seconds = time.perf_counter() - start, _children_cpu_s() - cpu_start
    last_line = (done.stderr.strip().splitlines() or [""])[-1]
    if done.returncode == 2:
        return [na_row(f"torchparity check could not run: {last_line}", **fields)]
    # CPU time beside wall time: on a shared machine the wall clock also counts other jobs.
    row = {**fields, "status": "ok", "wall_s": seconds, "cpu_s": cpu_seconds,
           "exit_code": done.returncode}
    if done.returncode != 0:
        row["note"] = f"check reported failures (exit {done.returncode}); the time still counts"
    return [row]


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
