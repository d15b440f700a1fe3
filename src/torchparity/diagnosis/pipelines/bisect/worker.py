"""A bisection in a process of its own: ``python -m torchparity.diagnosis.pipelines.bisect.worker
REQUEST RESULT``. REQUEST is a JSON file naming the entry, the cell and the repeats; the
outcome, or the one-line error of a mistake, is written to RESULT as JSON. Progress goes to
standard output as the runs finish."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from torchparity.diagnosis.pipelines.bisect.engine import bisect
from torchparity.errors import TorchParityError
from torchparity.golden.cells import Cell


def main(request_path: str, result_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    try:
        outcome = bisect(request["entry"], Cell(**request["cell"]), repeats=request["repeats"])
        answer = {"outcome": outcome.to_dict()}
    except TorchParityError as exc:
        answer = {"error": str(exc), "exit_status": getattr(exc, "exit_status", 2)}
    Path(result_path).write_text(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
