"""Throughput, start-up and the cost of the safety net itself (``torchparity bench``).

:func:`run_bench` measures the parts in :data:`~torchparity.bench.settings.PARTS`, each in its own
module, and returns one JSON-ready document (schema :data:`SCHEMA`):

- ``throughput`` (:mod:`~torchparity.bench.throughput`): per reference model, size, dtype and
  attention backend, tokens/s against ``manual``, the first step, peak memory, compiles;
- ``diagnose`` (:mod:`~torchparity.bench.diagnose_cost`): :func:`torchparity.diagnose` and
  ``--against`` over a plain forward+backward, in time, memory and by stage;
- ``decode`` (:mod:`~torchparity.bench.decode_cost`): record + diagnose of a decoding across
  revisions over two plain decodings;
- ``check`` (:mod:`~torchparity.bench.check_time`): the wall time of ``torchparity check``;
- ``twins`` (:mod:`~torchparity.bench.twins_time`): a ``torchparity twins`` search of 100
  examples of a small attention twin.

Every part measures in the interleaved rounds of :mod:`~torchparity.bench.rounds`. A row that
could not be measured has ``status: "n/a"`` and a ``reason``; every number present is finite.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from torchparity.bench.check_time import check_rows
from torchparity.bench.decode_cost import decode_rows
from torchparity.bench.diagnose_cost import diagnose_rows
from torchparity.bench.host import load_average, machine_info
from torchparity.bench.rounds import Progress, na_row
from torchparity.bench.settings import PARTS, BenchSettings
from torchparity.bench.targets import evaluate_targets
from torchparity.bench.throughput import throughput_rows
from torchparity.bench.twins_time import twins_rows

SCHEMA = "torchparity.bench/1"
MEASURES = {"throughput": throughput_rows, "diagnose": diagnose_rows, "decode": decode_rows,
            "check": check_rows, "twins": twins_rows}


def run_bench(settings: BenchSettings, progress: Progress | None = None) -> dict[str, Any]:
    """Measure the parts in ``settings.parts``.

    Guarantees: every part in PARTS has a list of rows (a skipped part: one ``n/a`` row saying
    why); a row has ``status`` ``"ok"`` or ``"n/a"`` with a ``reason``; numbers are finite.

    Args:
        settings: what to measure.
        progress: told of each part and unit of work (default: draws nothing).

    Returns:
        The result document: the machine, the settings, each part's rows and the targets.
    """
    progress = progress or Progress()
    started = time.time()
    result: dict[str, Any] = {
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
