"""A command run as the ranks of ``torchrun``: started as N ranks, or joined as one."""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from torchparity.distributed import group, launch
from torchparity.errors import TorchParityError, UsageError
from torchparity.subject.factory import first_line
from torchparity.subject.slices import under_torchrun

_Result = TypeVar("_Result")

#: Seconds a launched run may take in all (environment variable, default one hour).
RUN_TIMEOUT_ENV = "TORCHPARITY_RUN_TIMEOUT"
_DEFAULT_RUN_TIMEOUT = 3600.0


def start(nproc: int | None, argv: list[str]) -> int | None:
    """Where a command that takes ``--nproc`` runs.

    Args:
        nproc: ``--nproc``, or None.
        argv: the command's arguments after ``torchparity``.

    Returns:
        None under torchrun (the ranks joined, all but rank 0 silenced: the command runs here as
        one rank) or as one process; with ``nproc`` > 1 outside torchrun, the exit status of
        ``torchparity argv`` run as ``nproc`` ranks.

    Raises:
        TorchParityError: a rank failed or the run timed out, naming the rank.
    """
    if under_torchrun():
        if nproc is not None and nproc != group.world_size():
            raise UsageError(f"--nproc {nproc} under a torchrun of {group.world_size()} "
                             "ranks; leave --nproc out inside torchrun")
        launch.die_with_parent()
        command = next((arg for arg in argv if not arg.startswith("-")), "")
        group.join(f"torchparity {command}".strip())
        atexit.register(group.leave)
        if group.rank() != 0:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the rank)
        return None
    if nproc is not None and nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {nproc}")
    if nproc is None or nproc == 1:
        return None
    outcome = launch.launch("torchparity", without_nproc(argv), nproc=nproc,
                            timeout=group.seconds_from_env(RUN_TIMEOUT_ENV,
                                                           _DEFAULT_RUN_TIMEOUT), log=print)
    if outcome.message:
        print(outcome.message, file=sys.stderr)
    return outcome.status


def without_nproc(argv: list[str]) -> list[str]:
    """``argv`` without its ``--nproc N`` (or ``--nproc=N``): what each rank runs."""
    kept_args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            kept_args.append(arg)
    return kept_args


def collectively(what: str, fn: Callable[[], _Result]) -> _Result:
    """``fn()`` run by every rank; a failed collective said in one line naming ``what`` and where
    the other ranks are."""
    try:
        return fn()
    except Exception as exc:
        if not group.collective_failed(exc):
            raise
        raise TorchParityError(
            f"a collective failed in {what} "
            f"({group.where_others_are()}): {first_line(exc.__cause__ or exc)}") from exc
