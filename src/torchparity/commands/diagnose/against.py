"""``torchparity diagnose`` with A recorded: from a trace (``--against``), or recorded on a
base revision by ``record`` with the options given here (``--base``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from torchparity.commands.diagnose.decode_options import decode_options
from torchparity.commands.diagnose.trace_options import record_options
from torchparity.errors import UsageError
from torchparity.revisions.base import BaseSide
from torchparity.subject import Subject

if TYPE_CHECKING:
    from torchparity.diagnosis.core.align import NameMap
    from torchparity.diagnosis.reports.diagnosis import Report


def against_trace(args: argparse.Namespace, name_map: NameMap | None) -> Report:
    """B, the one ENTRY, against the trace ``--against`` names."""
    if len(args.entries) != 1 or args.backend_a or args.stream or args.include or \
            args.exclude or args.dtype or args.tokens or args.steps is not None or \
            args.beams is not None or args.sample:
        raise UsageError("with --against give one entry point (B); the trace fixes A's "
                         "backend, module selection, dtype, storage, decoded tokens, beams "
                         "and sampling")
    return _judged_against(args, Path(args.against), Subject.load(args.entries[0]), name_map)


def against_base(args: argparse.Namespace, side: BaseSide, name_map: NameMap | None
                 ) -> Report:
    """B, the working tree's ENTRY, against the trace ``record`` writes of it at the base."""
    from torchparity.revisions import base_trace

    if len(args.entries) != 1 or args.against:
        raise UsageError("with --base give one entry point: the working tree's is B, the "
                         "base's A (not --against: the base records the trace)")
    decode_options(args)  # the decoding options without --decode are a usage error here
    if args.decode and args.ops:  # said before the base is checked out and recorded
        from torchparity.diagnosis.pipelines.forward import DECODE_OPS

        raise UsageError(DECODE_OPS)
    # a decoding's ops are kept beside its whole trace: recorded again with them
    only = [] if args.decode else ["--ops-only"]
    b = Subject.load(args.entries[0])
    options, files = record_options(args)
    trace = base_trace(side, args.entries[0], options, files)

    def with_ops(modules: list[str]) -> Path:  # only when a module diverges: its ops at base
        return base_trace(side, args.entries[0],
                          [*options, "--ops", ",".join(modules), *only], files)

    return _judged_against(args, trace, b, name_map, with_ops)


def _judged_against(args: argparse.Namespace, trace: Path, b: Subject,
                    name_map: NameMap | None, more_ops: Callable[[list[str]], Path] | None = None
                    ) -> Report:
    from torchparity.diagnosis.pipelines.forward import diagnose_against

    return diagnose_against(trace, b.model, b.inputs, loss_fn=b.loss_fn, name_map=name_map,
                            backward=None if args.backward else False, backend=args.backend_b,
                            local=args.local, padding=b.padding, compile_b=args.compile_b,
                            step=b.stepper() if b.has_step else None, reorder=b.reorderer(),
                            decode=args.decode, ops=args.ops, more_ops=more_ops)
