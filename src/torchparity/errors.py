"""Exceptions that carry a one-line message meant for the user."""

from __future__ import annotations


class TorchParityError(Exception):
    """A mistake in user input or files: one line naming the fix, exit status 2, no traceback."""


class UsageError(TorchParityError):
    """A command-line argument or API argument is invalid."""


class BackendUnavailable(TorchParityError):
    """The requested attention backend cannot run here (device, dtype or feature)."""


class UserCodeError(TorchParityError):
    """The user's own code (a factory, its loss or step) raised: one line naming both, exit 3."""

    exit_status = 3


class RanksDisagree(TorchParityError):
    """Ranks hold different copies of what they must hold alike: a failed check (exit 1)."""

    exit_status = 1
    #: What the CLI's line says it is: a failed check, not a mistake.
    label = "FAILED"
    #: Every rank raises it together, so the ranks may still leave their group together.
    every_rank = True
