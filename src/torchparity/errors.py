"""Exceptions that carry a one-line message meant for the user."""

from __future__ import annotations


class TorchParityError(Exception):
    """A mistake in user input or files: the message names what is wrong and how to fix it.

    The CLI prints it as one line and exits with status 2, never with a traceback.
    """


class UsageError(TorchParityError):
    """A command-line argument or API argument is invalid."""


class BackendUnavailable(TorchParityError):
    """The requested attention backend cannot run here (device, dtype or feature)."""


class UserCodeError(TorchParityError):
    """The user's own code (a model factory, its loss or decode step) raised an exception.

    The message names the code and its exception in one line; the CLI exits with status 3.
    """

    exit_status = 3


class RanksDisagree(TorchParityError):
    """Ranks hold different copies of what they must hold alike (a replicated weight, an
    output every rank keeps whole): a failed check, found and raised by every rank at once.

    The CLI prints it as one line and exits with status 1.
    """

    exit_status = 1
    #: What the CLI's line says it is: a failed check, not a mistake.
    label = "FAILED"
    #: Every rank raises it together, so the ranks may still leave their group together.
    every_rank = True
