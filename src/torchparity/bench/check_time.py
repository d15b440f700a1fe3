"""Part ``check``: the wall time of ``torchparity check``, run as a user runs it."""

from __future__ import annotations

import os

from torchparity.bench.rounds import Progress, Row, na_row
from torchparity.bench.settings import BenchSettings
from torchparity.bench.timing import timed_command

CHECK_COMMAND = ("torchparity", "check")


def check_rows(settings: BenchSettings, progress: Progress) -> list[Row]:
    """Wall and CPU seconds of ``torchparity check`` with no options (not with ``quick``)."""
    fields = {"command": " ".join(CHECK_COMMAND), "logical_cores": os.cpu_count()}
    if settings.quick:
        return [na_row("not measured: --quick does not time `torchparity check` (about a "
                       "minute); run without --quick", **fields)]
    progress.start("check", 1)
    progress.advance("torchparity check")
    done, seconds, cpu_seconds = timed_command(CHECK_COMMAND[1:])
    last_line = (done.stderr.strip().splitlines() or [""])[-1]
    if done.returncode == 2:
        return [na_row(f"torchparity check could not run: {last_line}", **fields)]
    row = {**fields, "status": "ok", "wall_s": seconds, "cpu_s": cpu_seconds,
           "exit_code": done.returncode}
    if done.returncode != 0:
        row["note"] = f"check reported failures (exit {done.returncode}); the time still counts"
    return [row]

