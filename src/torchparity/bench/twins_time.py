"""Part ``twins``: a search of ``torchparity twins`` over a small attention twin, as a user
runs it.

The pair is :class:`~torchparity.bench.models.ThreeProjectionAttention` against its fused
refactor (the pair of docs/twins.md): d_model 16, 1 to 4 heads with and without GQA, fp32 and
bf16, as written and on SDPA's math kernel, every example forward and backward. The command
runs in a fresh folder, so no hypothesis database from an earlier run replays examples.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from torchparity.bench.host import load_average
from torchparity.bench.rounds import Progress, na_row
from torchparity.bench.settings import BenchSettings
from torchparity.bench.timing import timed_command

#: The examples of the target's search; ``--quick`` searches fewer.
EXAMPLES, QUICK_EXAMPLES = 100, 10
PAIR = "torchparity.bench.models:ThreeProjectionAttention", \
    "torchparity.bench.models:FusedProjectionAttention"
OPTIONS = ("--inputs", "attention", "--init", "d_model=16", "--init", "n_heads=1,2,4",
           "--init", "n_kv_heads=None,1", "--weight-map", "torchparity.bench.models:fuse_qkv",
           "--dtype", "fp32", "--dtype", "bf16", "--backend", "none", "--backend", "sdpa-math")


def twins_command(examples: int) -> tuple[str, ...]:
    """The ``torchparity twins`` command line the part times.

    Args:
        examples: the examples the search draws.

    Returns:
        The arguments after ``torchparity``.
    """
    return ("twins", *PAIR, *OPTIONS, "--examples", str(examples))


def twins_rows(settings: BenchSettings, progress: Progress) -> list[dict[str, Any]]:
    """Wall and CPU seconds of one twins search, with the 1-minute load before and after.

    The load says whether another job shared the machine while it ran.

    Args:
        settings: ``quick`` searches fewer examples.
        progress: advanced once the search is done.

    Returns:
        One row, or an ``n/a`` row saying why it did not run.
    """
    examples = QUICK_EXAMPLES if settings.quick else EXAMPLES
    command = twins_command(examples)
    fields = {"command": "torchparity " + " ".join(command), "examples": examples,
              "logical_cores": os.cpu_count()}
    progress.start("twins", 1)
    progress.advance(f"torchparity twins, {examples} examples")
    load_before = load_average()
    with tempfile.TemporaryDirectory() as fresh:
        done, seconds, cpu_seconds = timed_command(command, cwd=fresh)
    if done.returncode != 0:
        last_line = (done.stderr.strip().splitlines() or [""])[-1]
        return [na_row(f"torchparity twins exited {done.returncode}: {last_line}", **fields)]
    return [{**fields, "status": "ok", "wall_s": seconds, "cpu_s": cpu_seconds,
             "load_before": load_before, "load_after": load_average(),
             "result": done.stdout.strip().splitlines()[-1]}]
