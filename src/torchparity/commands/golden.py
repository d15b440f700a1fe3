"""``torchparity golden update|verify|show``: create, verify or read the zoo's goldens;
``golden update|verify --model ENTRY`` do the same for a user's model."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torchparity.commands.common import GOLDEN_DIR_HELP, refuse_zoo_across_ranks
from torchparity.distributed import ranks
from torchparity.errors import UsageError
from torchparity.golden.cases import OUTPUT_KINDS, write_case
from torchparity.golden.cell_selection import select_cases
from torchparity.golden.cells import CheckResult
from torchparity.golden.runner import update_models, verify_cases, verify_models
from torchparity.golden.show import show_golden
from torchparity.golden.store import GoldenStore, default_golden_dir
from torchparity.golden.user_models import load_noting_draws, user_golden_dir
from torchparity.reference import zoo
from torchparity.subject import Subject
from torchparity.text import wrapped


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    update = actions.add_parser(
        "update", help="compute the goldens of zoo cases and write them",
        description="Compute the goldens (float64, CPU, manual backend) of the named zoo cases "
                    "(default: all) and write them atomically. Files whose values and metadata "
                    "did not change are left untouched; nothing is ever deleted.")
    update.add_argument("cases", nargs="*", metavar="CASE",
                        help="zoo case (default: all, or none with --model)")
    update.add_argument("--model", action="append", metavar="ENTRY",
                        help="your own model instead: file.py:factory or "
                             "package.module:factory (repeatable); its float64 goldens go to "
                             "DIR/<entry name>/, DIR defaulting to golden/ in the working "
                             "directory (see docs/your-model.md)")
    verify = actions.add_parser(
        "verify", help="check that the goldens are intact and that the code still makes them",
        description="Validate every golden file (readable, JSON matching its tensors, known "
                    "schema, current config) and recompute each case in float64 to confirm "
                    "the code still produces it. Exit status 0 ok, 1 a golden is no longer "
                    "reproduced, 2 a golden is missing or damaged.")
    verify.add_argument("cases", nargs="*", metavar="CASE", help="zoo case (default: all)")
    verify.add_argument("--model", action="append", metavar="ENTRY",
                        help="your own model instead (repeatable): its goldens are validated "
                             "and recomputed in float64")
    show = actions.add_parser("show", help="print a readable summary of one case's goldens")
    show.add_argument("case", metavar="CASE", help="the zoo case whose goldens to summarise")
    update.add_argument("--nproc", type=int, metavar="N",
                        help="with --model: compute the goldens sharded over N ranks by the "
                             "factory's parallelize plan, in float64 (starts torchrun; inside "
                             "your own torchrun leave it out); they check with any number of "
                             "ranks")
    for sub in (update, verify, show):
        sub.add_argument("--golden-dir", metavar="DIR", help=GOLDEN_DIR_HELP)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    refuse_zoo_across_ranks(args, getattr(args, "cases", None))
    if getattr(args, "model", None):
        launched = ranks.start(getattr(args, "nproc", None), args._argv)
        if launched is not None:
            return launched
        if args.cases:
            raise UsageError(f"golden {args.action} takes zoo cases or --model, not both (got "
                             f"{' '.join(args.cases)} and --model)")
        # Every factory loads first; an update says which of them draw machine-bound values.
        loaded = [load_noting_draws(entry, noting_draws=args.action == "update")
                  for entry in args.model]
        subjects = [subject for subject, _ in loaded]
        for warning in filter(None, (warning for _, warning in loaded)):
            console.print(wrapped(warning), markup=False)
        root = user_golden_dir(args.golden_dir)
        if args.action == "update":
            return _update_models(subjects, root, console)
        return _print_verified(((subject.name, results, f"{len(results)} outputs reproduced")
                                for subject, results in verify_models(subjects, root)), console)
    store = GoldenStore(default_golden_dir(args.golden_dir))
    if args.action == "update":
        return _update(store, select_cases(args.cases or None), console)
    store.require_root()
    if args.action == "verify":
        return _verify(store, select_cases(args.cases or None), console)
    show_golden(store, select_cases([args.case])[0], console)
    return 0


def _update(store: GoldenStore, cases: list[zoo.ZooCase], console: Any) -> int:
    from rich.progress import Progress

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("computing goldens", total=len(cases))
        for case in cases:
            progress.update(task, description=case.name)
            statuses = write_case(store, case)
            summary = ", ".join(f"{output} {status}" for output, status in statuses.items())
            progress.console.print(f"{case.name}: {summary}")
            progress.advance(task)
    console.print(f"goldens of {len(cases)} case(s) are in {store.root}")
    return 0


def _update_models(subjects: list[Subject], root: Path, console: Any) -> int:
    from rich.console import Console

    with Console(stderr=True).status("") as progress:
        def status(subject: Subject, text: str) -> None:
            progress.update(f"{subject.name}: float64 golden run" + (f", {text}" if text else ""))

        for subject, statuses, islands in update_models(subjects, root, status):
            summary = ", ".join(f"{output} {status}" for output, status in statuses.items())
            console.print(wrapped(f"{subject.name}: {summary}"), markup=False)
            if islands:
                console.print(wrapped(f"{subject.name}: {islands}"), markup=False)
    console.print(f"goldens of {len(subjects)} model(s) are in {root}", markup=False)
    return 0


def _verify(store: GoldenStore, cases: list[zoo.ZooCase], console: Any) -> int:
    status = _print_verified(((case.name, results, f"{len(OUTPUT_KINDS)} goldens reproduced")
                              for case, results in verify_cases(store, cases)), console)
    for name in sorted(set(store.cases()) - set(zoo.names())):
        console.print(f"note: {store.root / name} belongs to no zoo case (left in place; "
                      f"delete it by hand if the case was removed)", markup=False)
    return status


def _print_verified(verified: Iterable[tuple[str, list[CheckResult], str]], console: Any
                    ) -> int:
    """One line per case or model that reproduces its goldens (``ok`` and what), one per
    output that does not; 1 when any does not."""
    ok = True
    for name, results, reproduced in verified:
        failed = [r for r in results if not r.ok]
        ok &= not failed
        if not failed:
            console.print(f"{name}: ok ({reproduced})", markup=False)
        for r in failed:
            console.print(f"{name}: {r.output} {r.verdict}: {r.explain or r.reason}",
                          markup=False)
    return 0 if ok else 1
