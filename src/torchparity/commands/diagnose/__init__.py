"""``torchparity diagnose``: localise where two models, or a model and a trace, part.

    torchparity diagnose pkg.mod:make_a pkg.mod:make_b          # two models, one process
    torchparity diagnose pkg.mod:make --against base.tptrace    # against `torchparity record`
    torchparity diagnose pkg.mod:make_a pkg.mod:make_b --decode # where their decodings part
    torchparity diagnose pkg.mod:make --base origin/main        # against a git revision
    torchparity diagnose pkg.mod:make --nproc 2 --against T     # sharded, under torchrun
    torchparity diagnose pkg.mod:make_a pkg.mod:make_b --nproc 2  # both sharded
    torchparity diagnose pkg.mod:make --compile --bisect       # which compiler pass

A trace written by ``record --decode`` is recognised: B is decoded along its tokens. With
``--base REV`` the trace is recorded on REV, in a worktree of its own (see
:mod:`torchparity.revisions`), with the options of A given here. Exit
status 0 when no module's local error (or local gradient error) breaks its budget, and for a
decoding when no step leaves its budget and no token flip is a real change; 1 otherwise; 2
for usage errors.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console

from torchparity.ci import check_paths, diagnosis_outcome, publish
from torchparity.commands.common import (
    add_base_arguments,
    add_report_arguments,
    base_side,
    full_report_command,
    name_rules,
)
from torchparity.commands.diagnose.against import against_base, against_trace
from torchparity.commands.diagnose.bisect import add_bisect_arguments, run_bisect
from torchparity.commands.diagnose.decode_options import add_decode_arguments, decode_options
from torchparity.commands.diagnose.determinism import determinism
from torchparity.commands.diagnose.ranks import across_ranks
from torchparity.commands.diagnose.trace_options import (
    add_selection_arguments,
    dtype_option,
    rebuild_of,
)
from torchparity.errors import UsageError
from torchparity.subject import Subject
from torchparity.subject.compiling import MODES
from torchparity.subject.slices import under_torchrun


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("entries", nargs="+", metavar="ENTRY",
                        help="A and B as package.module:factory (or file.py:factory) returning "
                             "(model, inputs[, loss_fn]) or a dict with 'step'; only B with "
                             "--against")
    parser.add_argument("--against", metavar="TRACE", help="trace written by torchparity record")
    add_selection_arguments(parser)
    add_decode_arguments(parser)
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
    add_bisect_arguments(parser)
    parser.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                        help="keep A's side on disk so memory stays bounded (default: when "
                             "the two models take more than a quarter of the free memory)")
    parser.add_argument("--determinism", action="store_true",
                        help="run ENTRY twice and under another thread count, and name the "
                             "ops whose outputs differ between the runs, with their lines "
                             "(exit 1 when two runs differ)")
    parser.add_argument("--ops", metavar="MODULE",
                        help="drill B's MODULE down to its ops and source lines (default: the "
                             "first divergent module; with --against, A's ops must be in the "
                             "trace: `record --ops`; not with --decode)")
    parser.add_argument("--local", choices=("diverged", "all"), default="diverged",
                        help="modules that get a local error (module replay): those whose "
                             "propagated error diverged (default) or all")
    add_base_arguments(parser, "A is ENTRY there, recorded by `torchparity record` with "
                               "--backend-a, --dtype, --decode and its options, --include, "
                               "--exclude and --no-backward, and kept in a cache")
    parser.add_argument("--nproc", type=int, metavar="N",
                        help="run B sharded by its factory's plan as N ranks of torchrun, "
                             "against a trace recorded in one process (--against), or "
                             "against A sharded by its own")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("--html", metavar="PATH", help="write a self-contained HTML report")
    add_report_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.bisect or args.compile:
        return run_bisect(args)
    if args.determinism:
        return determinism(args)
    if args.nproc is not None or under_torchrun():
        return across_ranks(args)
    started = time.perf_counter()
    check_paths(args.summary, args.junit)
    name_map = name_rules(args.name_map)
    side = base_side(args)
    if side:
        report, compared = against_base(args, side, name_map), f"base {side.name}"
    elif args.against:
        report, compared = against_trace(args, name_map), f"the trace {args.against}"
    else:
        report, compared = _two_models(args, name_map), " and ".join(args.entries)
    report.show(Console(), args.json, args.html)
    outcome = diagnosis_outcome(report, f"{args.entries[-1]} against {compared}",
                                time.perf_counter() - started, full_report_command(args))
    outcome.full_report = args.html
    publish(outcome, args.summary, args.junit)
    return report.exit_status


def _two_models(args: argparse.Namespace, name_map):
    from torchparity.diagnosis.pipelines.decoding import diagnose_decode
    from torchparity.diagnosis.pipelines.forward import COMPILED_DECODING, DECODE_OPS, diagnose

    if len(args.entries) != 2:
        raise UsageError("give two entry points (A and B), or one with --against TRACE")
    decoding = decode_options(args)
    a, b = Subject.load(args.entries[0]), Subject.load(args.entries[1])
    if decoding:
        if args.compile_b:
            raise UsageError(COMPILED_DECODING)
        if args.ops:
            raise UsageError(DECODE_OPS)
        if args.stream or args.local != "diverged":
            raise UsageError("--stream and --local are options of a forward diagnosis; a "
                             "decoding keeps each step's calls, and replays none")
        return diagnose_decode(a.model, b.model, a.inputs, step=a.stepper(),
                               step_b=b.stepper(), reorder=a.reorderer(),
                               reorder_b=b.reorderer(), name_map=name_map,
                               include=args.include, exclude=args.exclude,
                               backends=(args.backend_a, args.backend_b),
                               dtype=dtype_option(args), rebuild=rebuild_of(args.entries[0]),
                               **decoding)
    return diagnose(a.model, b.model, a.inputs, loss_fn=a.loss_fn, name_map=name_map,
                    backward=args.backward, include=args.include, exclude=args.exclude,
                    backends=(args.backend_a, args.backend_b), stream=args.stream,
                    local=args.local, dtype=dtype_option(args), padding=a.padding,
                    compile_b=args.compile_b, ops=args.ops)
