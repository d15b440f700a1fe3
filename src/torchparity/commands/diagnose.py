"""``torchparity diagnose``: localise where two models, or a model and a trace, part.

    torchparity diagnose pkg.mod:make_a pkg.mod:make_b          # two models, one process
    torchparity diagnose pkg.mod:make --against base.tptrace    # against `torchparity record`

Exit status 0 when no module's local error (or local gradient error) breaks its budget, 1 when
one does, 2 for usage errors.
"""

from __future__ import annotations

import argparse

from rich.console import Console

from torchparity.commands.record import add_selection_arguments, dtype_option
from torchparity.errors import UsageError
from torchparity.subject import Subject
from torchparity.subject.compiling import MODES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("entries", nargs="+", metavar="ENTRY",
                        help="A and B as package.module:factory (or file.py:factory) returning "
                             "(model, inputs[, loss_fn]); only B with --against")
    parser.add_argument("--against", metavar="TRACE", help="trace written by torchparity record")
    add_selection_arguments(parser)
    parser.add_argument("--name-map", action="append", metavar="REGEX=REPLACEMENT",
                        help="map A's module names to B's (regex on A's whole name); repeatable")
    parser.add_argument("--backend-a", help="attention backend for A (not with --against)")
    parser.add_argument("--backend-b", help="attention backend for B")
    parser.add_argument("--compile-b", nargs="?", const="dynamic", choices=tuple(MODES),
                        metavar="FORM",
                        help="run B by torch.compile (FORM dynamic, the default, or static) "
                             "and name the first module whose compiled output leaves its "
                             "budget: B is compiled whole, then module by module where it "
                             "departs (a factory that returns a compiled model is diagnosed "
                             "so without this flag; see docs/compile.md)")
    parser.add_argument("--stream", action="store_true",
                        help="keep A's side on disk so memory stays bounded")
    parser.add_argument("--local", choices=("diverged", "all"), default="diverged",
                        help="modules that get a local error (module replay): those whose "
                             "propagated error diverged (default) or all")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("--html", metavar="PATH", help="write a self-contained HTML report")


def run(args: argparse.Namespace) -> int:
    from torchparity.diagnosis.api import diagnose, diagnose_against

    name_map = [_name_rule(rule) for rule in args.name_map or []] or None
    if args.against:
        if len(args.entries) != 1 or args.backend_a or args.stream or args.include or \
                args.exclude or args.dtype:
            raise UsageError("with --against give one entry point (B); the trace fixes A's "
                             "backend, module selection, dtype and storage")
        b = Subject.load(args.entries[0])
        backward = None if args.backward else False
        report = diagnose_against(args.against, b.model, b.inputs, loss_fn=b.loss_fn,
                                  name_map=name_map, backward=backward, backend=args.backend_b,
                                  local=args.local, compile_b=args.compile_b)
    else:
        if len(args.entries) != 2:
            raise UsageError("give two entry points (A and B), or one with --against TRACE")
        a, b = Subject.load(args.entries[0]), Subject.load(args.entries[1])
        report = diagnose(a.model, b.model, a.inputs, loss_fn=a.loss_fn, name_map=name_map,
                          backward=args.backward, include=args.include, exclude=args.exclude,
                          backends=(args.backend_a, args.backend_b), stream=args.stream,
                          local=args.local, dtype=dtype_option(args), compile_b=args.compile_b)
    report.print(Console())
    if args.json:
        report.to_json(args.json)
    if args.html:
        report.to_html(args.html)
    return 1 if report.first_divergence or report.first_grad_divergence else 0


def _name_rule(rule: str) -> tuple[str, str]:
    pattern, sep, replacement = rule.partition("=")
    if not sep or not pattern:
        raise UsageError(f"--name-map {rule!r} must look like REGEX=REPLACEMENT "
                         "(e.g. 'attn\\.q_proj=attn.query')")
    return pattern, replacement
