"""``torchparity record``: write a model's module-by-module trace on the base revision.

The model comes from an entry point ``package.module:factory`` (or ``path/to/file.py:factory``),
see :class:`torchparity.subject.Subject`. With ``--decode`` the trace holds a teacher-forced
decoding instead of one forward (and backward) pass.
"""

from __future__ import annotations

import argparse
import shlex

from torchparity.commands.common import without_options
from torchparity.commands.diagnose.decode_options import add_decode_arguments, decode_options
from torchparity.commands.diagnose.trace_options import (
    add_selection_arguments,
    dtype_option,
    rebuild_of,
)
from torchparity.errors import UsageError
from torchparity.subject import Subject


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("entry", help="package.module:factory or file.py:factory returning "
                                      "(model, inputs) or (model, inputs, loss_fn), or a dict "
                                      "with those keys and 'step'")
    parser.add_argument("-o", "--output", required=True, metavar="PATH",
                        help="trace directory to write (replaced if it is a trace)")
    add_selection_arguments(parser)
    add_decode_arguments(parser)
    parser.add_argument("--backend", help="attention backend to run the model under")
    parser.add_argument("--ops", metavar="all|MODULE[,MODULE]",
                        help="also keep A's ops (names, arguments, source lines, tensors) of "
                             "those modules' calls ('(model)': the root's), or of every "
                             "module's, so that `diagnose --against` drills down to the op "
                             "(with --decode: MODULE's first call at every step; see "
                             "docs/diagnose.md for the cost)")
    parser.add_argument("--ops-only", action="store_true",
                        help="with --ops MODULE, write only what their drill-down reads (one "
                             "forward and backward of A, no golden): what `diagnose --base` "
                             "records at the base when MODULE diverges")


def run(args: argparse.Namespace) -> int:
    from torchparity.diagnosis.core.reference import golden_warning
    from torchparity.diagnosis.core.trace import open_trace
    from torchparity.diagnosis.core.trace_meta import meta_from_json
    from torchparity.diagnosis.pipelines.decoding import record_decode
    from torchparity.diagnosis.pipelines.forward import record

    decoding = decode_options(args)
    subject = Subject.load(args.entry)
    if decoding and (args.ops_only or args.ops == "all"):
        raise UsageError("a decoding keeps the ops of the modules --ops names "
                         "(MODULE[,MODULE]), at every step, beside its whole trace")
    if decoding:
        path = record_decode(subject.model, subject.inputs, args.output,
                             step=subject.stepper(), reorder=subject.reorderer(),
                             include=args.include, exclude=args.exclude,
                             backend=args.backend, dtype=dtype_option(args),
                             rebuild=rebuild_of(args.entry), ops=args.ops,
                             recorded_by=_recorded_by(args), **decoding)
    else:
        path = record(subject.model, subject.inputs, args.output, loss_fn=subject.loss_fn,
                      backward=args.backward, include=args.include, exclude=args.exclude,
                      backend=args.backend, dtype=dtype_option(args), padding=subject.padding,
                      ops=args.ops, ops_only=args.ops_only,
                      recorded_by=_recorded_by(args))
    meta = meta_from_json(open_trace(path)[0])
    warning = golden_warning(meta.golden)
    if warning:
        print(warning)
    what = ""
    if decoding:
        search = (f" ({decoding['beams'].beams} beams)" if decoding["beams"] else
                  " (sampled)" if decoding["sample"] else "")
        what = f"a decoding of {meta.steps} step(s){search} of"
    print(f"recorded {what} {type(subject.model).__name__} to {path}".replace("  ", " "))
    return 0


def _recorded_by(args: argparse.Namespace) -> str:
    """This record command line without its ``--ops`` choice: kept in the trace, so that a
    drill-down missing A's ops of a module prints the command that adds them."""
    return shlex.join(["torchparity", *without_options(args._argv, ("--ops",), ("--ops-only",))])
