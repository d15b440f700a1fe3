"""Which compiler pass changed a compiled cell's numbers (``diagnose --compile --bisect``):
:func:`bisect_cell` runs ``.engine.bisect`` in a child process (the bisector's globals die
with it); ``.report`` says the outcome."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from torchparity.diagnosis.pipelines.bisect.engine import CACHES_OFF, BisectOutcome
from torchparity.errors import TorchParityError
from torchparity.golden.cells import Cell

__all__ = ["CACHES_OFF", "BisectError", "BisectOutcome", "bisect_cell"]


class BisectError(TorchParityError):
    """What the bisection's process reported in one line (a factory that does not load:
    status 2; a cell that diverges but cannot be bisected: 1), with that exit status."""

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status


def bisect_cell(entry: str, cell: Cell, *, repeats: int = 1) -> BisectOutcome:
    """Run ``cell`` of ``entry`` and, when it diverges, bisect the compiler in a child process
    whose progress lines pass through.

    Args:
        entry: the zoo case or the model's factory (``file.py:factory``).
        cell: the compiled cell (backend, dtype, device, compile form).
        repeats: runs of each verdict that must agree (more than one where kernels are not
            deterministic).

    Returns:
        The :class:`BisectOutcome` (``backend`` None: nothing to bisect, or every backend passed).
    """
    with tempfile.TemporaryDirectory(prefix="torchparity-bisect-") as folder:
        request, result = Path(folder) / "request.json", Path(folder) / "result.json"
        request.write_text(json.dumps({"entry": entry, "cell": dataclasses.asdict(cell),
                                       "repeats": repeats}))
        command = [sys.executable, "-m", "torchparity.diagnosis.pipelines.bisect.worker",
                   str(request), str(result)]
        with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as child:
            for line in child.stdout:  # its progress, as each run of the cell finishes
                print(line, end="", flush=True)
        if child.returncode != 0 or not result.exists():
            raise BisectError(f"the bisection's process failed (exit status "
                              f"{child.returncode}; its error is printed above)", 3)
        answer = json.loads(result.read_text())
    if "error" in answer:
        raise BisectError(answer["error"], answer["exit_status"])
    return BisectOutcome(**answer["outcome"])
