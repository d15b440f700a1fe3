"""``torchparity diagnose ENTRY --nproc N --against TRACE``: a sharded model's first divergence
across the ranks of torchrun, against a trace recorded in one process (see
:mod:`torchparity.diagnosis.across_ranks`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torchparity.errors import UsageError
from torchparity.subject import Subject


def across_ranks(args: argparse.Namespace) -> int:
    """Start the ranks (or run as one, under torchrun); rank 0 prints the first divergence
    once, and writes ``--json``. Exit status 1 when a module diverges."""
    from torchparity.golden import sharded

    if not args.against:
        raise UsageError("diagnose --nproc needs a trace of the correct model recorded in one "
                         "process: `torchparity record ENTRY -o TRACE`, then --against TRACE")
    if len(args.entries) != 1 or args.decode or args.ops or args.compile_b or args.base:
        raise UsageError("diagnose --nproc takes one entry point (B) with --against TRACE, "
                         "without --decode, --ops, --compile-b or --base")
    launched = sharded.start(args.nproc, args._argv)
    if launched is not None:
        return launched
    from torchparity.diagnosis.across_ranks import diagnose_across_ranks

    report = sharded.collectively("the diagnosis", lambda: diagnose_across_ranks(
        Path(args.against), Subject.load(args.entries[0])))
    if report is None:  # not rank 0: rank 0 speaks for every rank
        return 0
    print("\n".join(report.lines()))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2))
    return report.exit_status
