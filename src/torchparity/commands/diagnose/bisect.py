"""``torchparity diagnose ENTRY --compile [FORM] --bisect``: which compiler pass, lowering or
setting changed a compiled cell's numbers (see docs/compile.md).

Exit status 0 when the cell is within its budget compiled (nothing to bisect), 1 when it
diverges (bisected, or not: the line says why), 2 for usage errors.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torchparity.errors import UsageError
from torchparity.subject.compiling import MODES
from torchparity.text import wrapped

BISECT_NEEDS_COMPILE = ("--bisect bisects a compiled cell: add --compile [dynamic|static] "
                        "(e.g. torchparity diagnose ENTRY --compile --bisect)")


def add_bisect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile", nargs="?", const="dynamic", choices=tuple(MODES),
                        metavar="FORM",
                        help="with --bisect: the compiled cell of ENTRY (a factory or a zoo "
                             "case) in FORM (dynamic, the default, or static), on "
                             "--backend-b (default manual), --dtype (default fp32), "
                             "--device")
    parser.add_argument("--bisect", action="store_true",
                        help="when the compiled cell diverges, bisect the compiler with the "
                             "cell's verdict as the oracle, in a process of its own, and name "
                             "the pass or lowering, its graph, node and source line (tens of "
                             "compiles)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="the compiled cell's device (with --bisect; default cpu)")


def run_bisect(args: argparse.Namespace) -> int:
    """Run the compiled cell of ``args.entries[0]``; bisect it when it diverges."""
    from torchparity.diagnosis.pipelines.bisect import BisectError, bisect_cell
    from torchparity.diagnosis.pipelines.bisect.report import cost_json, lines, to_json
    from torchparity.golden.cells import Cell

    if not args.bisect:
        raise UsageError("--compile takes --bisect here; to name the module that departs "
                         "compiled use --compile-b, for the verdicts torchparity check "
                         "--compile")
    if not args.compile:
        raise UsageError(BISECT_NEEDS_COMPILE)
    if len(args.entries) != 1 or args.against or args.compile_b or args.nproc:
        raise UsageError("--bisect takes one ENTRY (a factory or a zoo case), without "
                         "--against, --compile-b or --nproc")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise UsageError(f"--json {args.json}: its folder does not exist")
    cell = Cell(args.backend_b or "manual", args.dtype or "fp32", args.device, args.compile)
    label = f"{args.entries[0]} {cell.label}"
    print(wrapped(f"{label}: one compiled run, then a bisection if it diverges"))
    repeats = 3 if cell.device == "cuda" else 1  # CUDA kernels need not be deterministic
    try:
        outcome = bisect_cell(args.entries[0], cell, repeats=repeats)
    except BisectError as exc:
        if exc.exit_status != 1:  # a mistake: one line from the command line's handler
            raise
        print(wrapped(f"{label}: {exc}"))
        _write(args.json, label, "diverged", None, None)
        return 1
    print("\n".join(lines(outcome, label)))
    verdict = "within" if outcome.bound == 0 else "diverged"
    _write(args.json, label, verdict, to_json(outcome), cost_json(outcome))
    return 0 if verdict == "within" else 1


def _write(path: str | None, label: str, verdict: str, found: dict | None,
           compiled: dict | None) -> None:
    if path:
        Path(path).write_text(json.dumps({"cell": label, "verdict": verdict, "bisect": found,
                                          "compiled": compiled}, indent=1))
