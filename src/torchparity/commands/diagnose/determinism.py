"""``torchparity diagnose --determinism ENTRY``: the ops where two runs of one model part."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from torchparity.commands.common import base_side
from torchparity.errors import UsageError
from torchparity.subject import Subject


def determinism(args: argparse.Namespace) -> int:
    """Run ENTRY twice and under another thread count, print the ops where the runs part
    (``--json``: the lists); exit 1 when two runs differ."""
    from torchparity.diagnosis.stages.ops.determinism import probe_determinism

    if len(args.entries) != 1 or args.against or base_side(args):
        raise UsageError("--determinism takes one entry point, the model to run again")
    subject = Subject.load(args.entries[0])
    found = probe_determinism(subject.model, subject.inputs)
    console = Console()
    for line in found.lines():
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if args.json:
        Path(args.json).write_text(json.dumps(found.to_dict(), indent=1))
    return 0 if found.deterministic else 1
