"""Part ``twins``: a ``torchparity twins`` search over docs/twins.md's pair, as a user runs it."""

from __future__ import annotations

import os
import tempfile

from torchparity.bench.host import load_average
from torchparity.bench.rounds import Progress, Row, na_row
from torchparity.bench.settings import BenchSettings
from torchparity.bench.timing import timed_command

#: The examples of the target's search; ``--quick`` searches fewer.
EXAMPLES, QUICK_EXAMPLES = 100, 10
PAIR = "torchparity.bench.models:ThreeProjectionAttention", \
    "torchparity.bench.models:FusedProjectionAttention"
OPTIONS = ("--inputs", "attention", "--init", "d_model=16", "--init", "n_heads=1,2,4",
           "--init", "n_kv_heads=None,1", "--weight-map", "torchparity.bench.models:fuse_qkv",
           "--dtype", "fp32", "--dtype", "bf16", "--backend", "none", "--backend", "sdpa-math")


# a fresh folder: no hypothesis database of an earlier run replays examples
def twins_command(examples: int) -> tuple[str, ...]:
    """The arguments after ``torchparity`` of the twins search the part times."""
    return ("twins", *PAIR, *OPTIONS, "--examples", str(examples))


def twins_rows(settings: BenchSettings, progress: Progress) -> list[Row]:
    """Wall and CPU seconds of one twins search, with the 1-minute load before and after."""
    examples = QUICK_EXAMPLES if settings.quick else EXAMPLES
    command = twins_command(examples)
    fields = {"command": "torchparity " + " ".join(command), "examples": examples,
              "logical_cores": os.cpu_count()}
    progress.start("twins", 1)
    progress.advance(f"torchparity twins, {examples} examples")
    # the load says whether another job shared the machine
    load_before = load_average()
    with tempfile.TemporaryDirectory() as fresh:
        done, seconds, cpu_seconds = timed_command(command, cwd=fresh)
    if done.returncode != 0:
        last_line = (done.stderr.strip().splitlines() or [""])[-1]
        return [na_row(f"torchparity twins exited {done.returncode}: {last_line}", **fields)]
    return [{**fields, "status": "ok", "wall_s": seconds, "cpu_s": cpu_seconds,
             "load_before": load_before, "load_after": load_average(),
             "result": done.stdout.strip().splitlines()[-1]}]
