"""Every file and folder a command writes, checked before it starts: a report (``--json``,
``--html``, ``--junit``, ``--summary``), a trace (``-o``) or the goldens an update writes. A run
of minutes must not end with a path it cannot write."""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from pathlib import Path

from torchparity.errors import UsageError

#: The options naming a report file, by their attribute.
REPORT_FILES = {"json": "--json", "html": "--html", "junit": "--junit", "summary": "--summary"}


def check_output_paths(args: argparse.Namespace) -> None:
    """Refuse a report file, trace folder (``-o``) or golden folder that the command could not
    write, in one line naming the path and what to do.

    Raises:
        UsageError: a path that cannot be written.
    """
    for attribute, flag in REPORT_FILES.items():
        path = getattr(args, attribute, None)
        if path:
            _check_writable(f"{flag} {path}", Path(path), folder=False)
    if getattr(args, "output", None):
        _check_writable(f"-o {args.output}", Path(args.output), folder=True)
    golden_dir = _written_golden_dir(args)
    if golden_dir is not None:
        _check_writable(f"golden folder {golden_dir}", golden_dir, folder=True)


def _written_golden_dir(args: argparse.Namespace) -> Path | None:
    """The golden folder this command writes (``golden update``, ``train --update-golden``),
    or None."""
    from torchparity.golden.store import default_golden_dir
    from torchparity.golden.user_models import user_golden_dir

    updates = getattr(args, "action", None) == "update" or getattr(args, "update_golden", False)
    if not updates:
        return None
    if getattr(args, "model", None):
        return user_golden_dir(args.golden_dir)
    with contextlib.suppress(UsageError):  # no folder to tell: the command says so itself
        return default_golden_dir(args.golden_dir)
    return None


def _check_writable(named: str, path: Path, folder: bool) -> None:
    """Refuse ``path`` unless it can be written. Writing is tried (the file opened to append, or
    a temporary file made in the folder and removed): permission bits mislead root, and a
    read-only mount or a special file system refuses what they allow."""
    fix = "make it writable or choose another folder" if folder else "choose another path"
    if path.exists() and path.is_dir() != folder:
        kind = "a folder" if path.is_dir() else "a file"
        raise UsageError(f"{named} is {kind}; give a {'folder' if folder else 'file'} path")
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if existing != path.absolute() and not existing.is_dir():
        raise UsageError(f"{named}: {existing} is a file, not a folder; choose another path")
    if not folder and existing not in (path.absolute(), path.absolute().parent):
        raise UsageError(f"{named}: its folder {path.absolute().parent} does not exist; create "
                         f"it or choose another path")
    try:
        if existing.is_dir():
            handle, probe = tempfile.mkstemp(dir=existing, prefix=".torchparity-probe-")
            os.close(handle)
            os.unlink(probe)
        else:
            with open(existing, "ab"):
                pass
    except OSError as exc:
        where = ("is not writable" if existing == path.absolute()
                 else f"cannot be made in {existing}")
        raise UsageError(f"{named} {where} ({exc.strerror or exc}); {fix}") from None
