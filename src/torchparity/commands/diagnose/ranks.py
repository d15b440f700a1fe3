"""``torchparity diagnose ENTRY --nproc N --against TRACE`` and ``diagnose A B --nproc N``: a
sharded model's first divergence across the ranks of torchrun, against a trace recorded in one
process or against another model sharded alike (see :mod:`torchparity.diagnosis.pipelines.ranks`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torchparity.errors import UsageError
from torchparity.subject import Subject

# The options of a diagnosis in one process, at their defaults: under --nproc any other value
# is refused, not ignored.
_DEFAULTS = {"include": None, "exclude": None, "dtype": None,
             "decode": False, "name_map": None, "backend_a": None, "backend_b": None,
             "compile_b": None, "stream": None, "ops": None, "local": "diverged",
             "base": None, "html": None, "summary": None, "junit": None}


def across_ranks(args: argparse.Namespace) -> int:
    """Start the ranks (or run as one, under torchrun); rank 0 prints the first divergence
    once, and writes ``--json``. Exit status 1 when a module diverges."""
    from torchparity.distributed.ranks import collectively, start

    if len(args.entries) != (1 if args.against else 2):
        raise UsageError("diagnose --nproc takes one entry point (B) with --against TRACE "
                         "(recorded in one process: `torchparity record ENTRY -o TRACE`), or "
                         "two (A and B, each sharded by its own plan)")
    given = [name for name, default in _DEFAULTS.items() if getattr(args, name) != default]
    if given:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"diagnose --nproc does not take {flags}: it judges B's module "
                         "outputs and gradients against A's, and takes --against, "
                         "--no-backward and --json only")
    launched = start(args.nproc, args._argv)
    if launched is not None:
        return launched
    from torchparity.diagnosis.pipelines.ranks import (
        diagnose_across_ranks,
        diagnose_pair_across_ranks,
    )

    if args.against:
        report = collectively("the diagnosis", lambda: diagnose_across_ranks(
            Path(args.against), Subject.load(args.entries[0]), backward=args.backward))
    else:
        report = collectively("the diagnosis", lambda: diagnose_pair_across_ranks(
            Subject.load(args.entries[0]), Subject.load(args.entries[1]), args.entries[0],
            backward=args.backward))
    if report is None:  # not rank 0: rank 0 speaks for every rank
        return 0
    print("\n".join(report.lines()))
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2))
    return report.exit_status
