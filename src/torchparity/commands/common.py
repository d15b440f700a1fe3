"""Argument handling shared by the subcommands."""

from __future__ import annotations

import argparse
import shlex
from typing import TYPE_CHECKING

import torch

from torchparity.dtypes import dtype_name
from torchparity.errors import UsageError
from torchparity.golden.store import GOLDEN_DIR_ENV
from torchparity.revisions.base import BaseSide
from torchparity.revisions.cache import CACHE_ENV

if TYPE_CHECKING:
    from torchparity.subject import Subject

__all__ = ["GOLDEN_DIR_HELP", "add_base_arguments", "add_report_arguments", "base_side",
           "dtype_name", "resolve_device"]

#: Where ``--golden-dir`` defaults (``default_golden_dir``, and ``user_golden_dir`` for --model).
GOLDEN_DIR_HELP = (f"folder of the goldens (default: ${GOLDEN_DIR_ENV}, else with --model golden/ "
                   "in the working directory, else golden/ of the torchparity source tree around "
                   "the working directory or torchparity is imported from, else the goldens "
                   "shipped in the installed package)")


def resolve_device(name: str | None) -> str:
    """``name``, or ``cuda`` when available else ``cpu``; a one-line error for a device that is
    not a torch device or, for CUDA, not present."""
    device = name or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a torch device (try cpu or cuda)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device} asked for, but no CUDA device is available here; "
                         "use --device cpu")
    return device


def add_base_arguments(parser: argparse.ArgumentParser, side: str) -> None:
    """``--base REV`` and its options; ``side`` says what the base side makes."""
    parser.add_argument("--base", metavar="REV",
                        help=f"compare the working tree with git revision REV (a branch, a "
                             f"tag, HEAD~1, A...B for their merge base), checked out in a "
                             f"temporary worktree and run in a process of its own, leaving "
                             f"the checkout, index and branches alone: {side} (docs/ci.md)")
    parser.add_argument("--base-python", metavar="PATH",
                        help="interpreter of the base side (default: this one), for a base "
                             "that needs its own environment")
    parser.add_argument("--no-base-cache", dest="base_cache", action="store_false",
                        help=f"recompute the base side even when the cache has it (the cache: "
                             f"${CACHE_ENV}, else torchparity/base under $XDG_CACHE_HOME or "
                             f"~/.cache)")


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """``--summary`` and ``--junit``: the reports CI shows."""
    parser.add_argument("--summary", metavar="PATH",
                        help="append a Markdown summary (at most 40 lines) to PATH, e.g. "
                             "$GITHUB_STEP_SUMMARY or a pull-request comment's file")
    parser.add_argument("--junit", metavar="PATH",
                        help="write JUnit XML to PATH, a test case per verdict (under GitHub "
                             "Actions, GITHUB_ACTIONS=true, a failure is also printed as ::error "
                             "annotations, with or without these options)")


def base_side(args: argparse.Namespace) -> BaseSide | None:
    """The base side ``--base`` asks for (None without it)."""
    if not args.base:
        if args.base_python or not args.base_cache:
            raise UsageError("--base-python and --no-base-cache are options of --base REV")
        return None
    return BaseSide(args.base, python=args.base_python, use_cache=args.base_cache)


def full_report_command(args: argparse.Namespace) -> str | None:
    """This very command with ``--html``: every module, its cells' evidence and the chart,
    for the reader of a CI summary; None when it had ``--html`` (the page is written)."""
    if args.html:
        return None
    kept = without_options(args._argv, ("--summary", "--junit"))  # CI's paths: not again
    return shlex.join(["torchparity", *kept, "--html", "diagnosis.html"])


def without_options(argv: list[str], valued: tuple[str, ...], flags: tuple[str, ...] = ()
                    ) -> list[str]:
    """``argv`` without the options ``valued`` (with their values, spelt either way) and the
    ``flags``."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in valued:
            skip = True
        elif arg not in flags and not arg.startswith(tuple(f"{o}=" for o in valued)):
            kept.append(arg)
    return kept


def next_step_command(base: str | None, subjects: list[Subject], results: list) -> str | None:
    """``torchparity diagnose ENTRY --base REV`` for the first model that failed against its
    base: the command that names the module where it changed."""
    failed = next((r.case for r in results if not r.ok), None)
    entry = next((s.entry for s in subjects if s.name == failed), None)
    if base is None or entry is None:
        return None
    return f"torchparity diagnose {shlex.quote(entry)} --base {shlex.quote(base)}"


def refuse_zoo_across_ranks(args: argparse.Namespace, zoo_cases: list[str] | None) -> None:
    """``--nproc`` (or a torchrun of the user's) shards each ``--model`` by its factory's
    plan; the zoo's cases (``zoo_cases``, or all of them without ``--model``) run in one
    process. Asked across ranks, they are a usage error, not the same work on every rank."""
    from torchparity.subject.slices import under_torchrun

    across = (getattr(args, "nproc", None) or 1) > 1 or under_torchrun()
    if across and (zoo_cases or not getattr(args, "model", None)):
        raise UsageError("--nproc shards each --model ENTRY by its factory's plan; the zoo's "
                         "cases run in one process: leave --nproc out for them")


def name_rules(rules: list[str] | None) -> list[tuple[str, str]] | None:
    """``--name-map REGEX=REPLACEMENT`` options as (pattern, replacement) pairs (None for
    none)."""
    return [_name_rule(rule) for rule in rules or []] or None


def _name_rule(rule: str) -> tuple[str, str]:
    pattern, sep, replacement = rule.partition("=")
    if not sep or not pattern:
        raise UsageError(f"--name-map {rule!r} must look like REGEX=REPLACEMENT "
                         "(e.g. 'attn\\.q_proj=attn.query')")
    return pattern, replacement
