"""A revision of the user's repository checked out where it harms nothing.

Only ``git rev-parse``, ``merge-base`` and ``worktree add --detach / remove / prune`` touch the
repository: checkout, index, stash and branches stay. The worktree lives in a temporary folder,
removed when the block ends, also on failure, Ctrl-C and SIGTERM (a cancelled CI job).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from torchparity.errors import UsageError
from torchparity.golden.golden_sets import sigterm_interrupts


class RevisionError(UsageError):
    """A revision that git cannot name or check out (exit status 2)."""


@dataclass(frozen=True)
class Repository:
    """The git repository around ``cwd``: its top folder and where ``cwd`` sits in it."""

    top: Path
    prefix: Path  # cwd relative to ``top``

    @classmethod
    def around(cls, cwd: Path, option: str) -> Repository:
        """The repository around ``cwd``; ``RevisionError`` outside one, or without git."""
        if shutil.which("git") is None:
            # Said before asking git, so a missing git is not blamed on the folder.
            raise RevisionError(f"{option} needs git, and there is no git on PATH")
        try:
            top = _git(cwd, "rev-parse", "--show-toplevel")
        except RevisionError:
            raise RevisionError(f"{option} needs a git repository, and {cwd} is not in one") \
                from None
        return cls(Path(top), Path(cwd).resolve().relative_to(Path(top).resolve()))

    def resolve(self, revision: str, option: str) -> str:
        """The full commit hash ``revision`` names; ``A...B``: their merge base, as git diff.

        Raises:
            RevisionError: git cannot name that commit, with git's reason (naming ``option``).
        """
        left, dots, right = revision.partition("...")
        try:
            if dots:
                return _git(self.top, "merge-base", left or "HEAD", right or "HEAD")
            return _git(self.top, "rev-parse", "--verify", "--quiet", "--end-of-options",
                        f"{revision}^{{commit}}")
        except RevisionError as exc:
            reason = str(exc) or "no such revision"
            raise RevisionError(f"{option} {revision}: git cannot name that commit "
                                f"({reason})") from None

    def has_file(self, commit: str, path: str) -> bool:
        """Whether ``commit`` has a file (a blob) at ``path``, relative to the top folder."""
        try:
            return _git(self.top, "cat-file", "-t", f"{commit}:{path}") == "blob"
        except RevisionError:
            return False

    @contextlib.contextmanager
    def worktree(self, commit: str) -> Iterator[Path]:
        """A detached worktree of ``commit`` in a temporary folder, removed whatever happens.

        Raises:
            RevisionError: git cannot check the commit out.
        """
        folder = Path(tempfile.mkdtemp(prefix="torchparity-base-"))
        tree = folder / "tree"
        try:
            with sigterm_interrupts():
                try:
                    _git(self.top, "worktree", "add", "--detach", "--quiet", str(tree), commit)
                except RevisionError as exc:
                    raise RevisionError(f"--base: git cannot check {commit[:12]} out "
                                        f"({exc})") from None
                yield tree
        finally:
            with contextlib.suppress(RevisionError):
                _git(self.top, "worktree", "remove", "--force", str(tree))
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(RevisionError):
                _git(self.top, "worktree", "prune")


def _git(cwd: Path, *args: str) -> str:
    """``git args`` in ``cwd``: its stdout, or a RevisionError with git's first message line."""
    try:
        done = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              check=False)
    except FileNotFoundError:
        raise RevisionError("--base needs git, and there is no git on PATH") from None
    if done.returncode != 0:
        lines = [line.removeprefix("fatal: ").removeprefix("error: ")
                 for line in done.stderr.splitlines() if line.strip()]
        raise RevisionError(lines[0] if lines else "")
    return done.stdout.strip()
