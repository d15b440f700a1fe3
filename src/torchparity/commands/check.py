"""``torchparity check``: the pre-merge command.

Checks every zoo case against its golden outputs in every cell (attention backend x dtype x
device) this machine offers and prints a table: rows are cases, columns backends, each cell the
verdict and headroom (share of the tolerance budget used) per dtype. Exit status 0 when every
cell passes, 1 when any output diverged or its weights/inputs changed, 2 for a usage or golden
error. See :mod:`torchparity.golden.check_loop` for what is compared and how.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any

from torchparity import backends
from torchparity.ci import check_outcome, check_paths, publish
from torchparity.commands.common import (
    GOLDEN_DIR_HELP,
    add_base_arguments,
    add_report_arguments,
    base_side,
    dtype_name,
    name_rules,
    next_step_command,
    refuse_zoo_across_ranks,
)
from torchparity.distributed import ranks
from torchparity.errors import UsageError
from torchparity.golden.cell_selection import CHECK_DTYPES, compile_forms
from torchparity.golden.runner import CheckRequest, check_goldens
from torchparity.revisions import base_goldens
from torchparity.subject import Subject
from torchparity.subject.compiling import MODES
from torchparity.train.check_feed import trajectory_feeds

#: What ``--compile`` takes: one compile form, or both.
COMPILE_CHOICES = (*MODES, "both")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Compare every zoo case with its goldens, forward and backward, on every attention "
        "backend and dtype available (fp32 and bf16 on the CPU; also tf32 and fp16 on CUDA). "
        "The reference column recomputes the goldens in float64 and catches changed math; the "
        "other columns are judged by the tolerance model against the manual backend in the "
        "same dtype. With --model, your own model is checked the same way against its goldens "
        "(docs/your-model.md). Exit status: 0 all pass, 1 something diverged, 2 usage or "
        "golden error, 3 your model's code (or torchparity) raised, 130 interrupted.")
    parser.add_argument("--case", action="append", metavar="NAME",
                        help="zoo case to check (repeatable; default: all, or none with "
                             "--model)")
    parser.add_argument("--model", action="append", metavar="ENTRY",
                        help="your own model: file.py:factory or package.module:factory, a "
                             "callable returning (model, inputs[, loss_fn]) (repeatable; see "
                             "docs/your-model.md); its goldens come from `torchparity golden "
                             "update --model ENTRY`")
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help=f"attention backend (repeatable; default: all of "
                             f"{', '.join(backends.names())}; with a transformers --model "
                             f"also hf-eager, its eager attention)")
    parser.add_argument("--dtype", action="append", metavar="DTYPE", type=dtype_name,
                        help=f"dtype (repeatable; one of {', '.join(CHECK_DTYPES)}, or torch's "
                             f"names such as float32 and bfloat16; default: "
                             f"fp32, bf16 on cpu and also tf32, fp16 on cuda)")
    parser.add_argument("--device", action="append", metavar="DEVICE",
                        help="device (repeatable; default: cpu, and cuda when available)")
    parser.add_argument("--name-map", action="append", metavar="REGEX=REPLACEMENT",
                        help="map the goldens' module names to --model's where a refactor "
                             "renamed them (regex on the whole name); repeatable")
    parser.add_argument("--golden-dir", metavar="DIR", help=GOLDEN_DIR_HELP)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--html", metavar="PATH",
                        help="also write the report as a self-contained HTML page to PATH")
    parser.add_argument("--jobs", type=int, metavar="N",
                        help="worker processes (default: 2 when the machine has 2+ cores; 1 "
                             "runs in this process)")
    parser.add_argument("--compile", nargs="?", const="both", choices=COMPILE_CHOICES,
                        metavar="FORM",
                        help="also run every cell compiled by torch.compile (Inductor) and "
                             "judge it the same way: FORM dynamic (dynamic=True), static "
                             "(dynamic=False) or both (the default); shows graphs, graph "
                             "breaks and recompiles per cell and per decoding step. Slow on a "
                             "CPU: tens of seconds per cell when Inductor's cache is cold "
                             "(docs/compile.md)")
    parser.add_argument("--train", action="store_true",
                        help="also train each case's golden recipe (20 steps) in every cell "
                             "but the reference one and judge the loss, gradient-norm and "
                             "update-norm trajectory against the golden trajectory")
    parser.add_argument("--nproc", type=int, metavar="N",
                        help="check each --model sharded over N ranks by its factory's "
                             "parallelize plan: starts torchrun (gloo on the CPU, nccl with a "
                             "GPU per rank); inside your own torchrun leave it out "
                             "(docs/your-model.md)")
    add_base_arguments(parser, "there `torchparity golden update --model` makes the "
                               "entries' float64 goldens, kept in a cache; yours are never "
                               "written")
    add_report_arguments(parser)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    refuse_zoo_across_ranks(args, args.case)
    launched = ranks.start(args.nproc, args._argv)
    if launched is not None:
        return launched
    check_paths(args.summary, args.junit)
    side = base_side(args)
    if side and (args.case or not args.model or args.golden_dir or args.train):
        raise UsageError("--base checks --model entries against the base's goldens, made on "
                         "the fly: give --model ENTRY, without --case, --golden-dir or --train")
    subjects = [Subject.load(entry) for entry in args.model or []]
    with contextlib.ExitStack() as stack:
        base_root = stack.enter_context(base_goldens(side, args.model)) if side else None
        request = CheckRequest(
            cases=args.case, models=subjects, backend=args.backend, dtype=args.dtype,
            device=args.device, compile_forms=compile_forms(args.compile),
            golden_dir=args.golden_dir, model_root=base_root, jobs=args.jobs,
            train=trajectory_feeds if args.train else None, json=args.json, html=args.html,
            name_map=name_rules(args.name_map))
        report = check_goldens(request, _progress())
        elapsed = time.perf_counter() - started

        from rich.console import Console

        report.render(Console(soft_wrap=True), elapsed)
        report.write(args.json, args.html, elapsed)
        compared = (f"{', '.join(args.model)} against base {side.name}" if side else
                    f"the goldens in {report.model_root}")
        next_step = next_step_command(args.base, subjects, report.results)
        publish(check_outcome(report.results, compared, elapsed, next_step), args.summary,
                args.junit)
        return 0 if report.ok else 1


def _progress() -> Any:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description:<36}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=True)
