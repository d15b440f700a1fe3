"""Throughput, start-up and the cost of the safety net itself (``torchparity bench``).

:func:`run_bench` measures each part of :data:`~torchparity.bench.settings.PARTS` (one module
each) in interleaved rounds and returns one JSON-ready document (schema :data:`SCHEMA`).
"""

from __future__ import annotations

import dataclasses
import time

from torchparity.bench.check_time import check_rows
from torchparity.bench.decode_cost import decode_rows
from torchparity.bench.diagnose_cost import diagnose_rows
from torchparity.bench.host import load_average, machine_info
from torchparity.bench.rounds import Document, Progress, na_row
from torchparity.bench.settings import PARTS, BenchSettings
from torchparity.bench.targets import evaluate_targets
from torchparity.bench.throughput import throughput_rows
from torchparity.bench.twins_time import twins_rows

SCHEMA = "torchparity.bench/1"
MEASURES = {"throughput": throughput_rows, "diagnose": diagnose_rows, "decode": decode_rows,
            "check": check_rows, "twins": twins_rows}


def run_bench(settings: BenchSettings, progress: Progress | None = None) -> Document:
    """Measure ``settings.parts``: the machine, the settings, each part's rows and the targets.

    Every part has a list of rows (a skipped part: one ``n/a`` row saying why); a row has
    ``status`` ``"ok"`` or ``"n/a"`` with a ``reason``; every number is finite.
    """
    progress = progress or Progress()
    started = time.time()
    result: Document = {
        "schema": SCHEMA,
        "machine": machine_info(settings.device, settings.threads),
        "settings": dataclasses.asdict(settings),
    }
    for part in PARTS:
        if part in settings.parts:
            result[part] = MEASURES[part](settings, progress)
        else:
            result[part] = [na_row(f"not measured: the {part} part was skipped (--skip {part})")]
    result["machine"]["load_average_end"] = load_average()
    result["wall_s"] = time.time() - started
    result["targets"] = evaluate_targets(result)
    return result
