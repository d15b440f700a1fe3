"""The ``torchparity`` command.

Each subcommand lives in ``torchparity.commands.<name>`` and provides ``add_arguments(parser)``
and ``run(args) -> int``; they are imported only when used so ``torchparity --help`` is instant.
Exit codes: 0 success, 1 a check failed, 2 a usage or file error, 3 an unexpected error (the
user's own code, such as a model factory, raised, or torchparity itself failed), 130 interrupted
(Ctrl-C). Errors are one line on stderr; for an unexpected one it names the exception and the
innermost frame, and ``--debug`` prints the traceback as well.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import sysconfig
import traceback
from pathlib import Path

from torchparity import __version__
from torchparity.collector import older_objects_frozen
from torchparity.errors import TorchParityError

EXIT_USAGE, EXIT_UNEXPECTED = 2, 3
EXIT_STATUSES = ("exit status: 0 every check passed, 1 a check failed, 2 a usage or file error, "
                 "3 an unexpected error (--debug shows its traceback), 130 interrupted (Ctrl-C)")

COMMANDS = {
    "check": "compare the reference zoo with the shipped goldens on every backend and dtype",
    "golden": "create, verify or show golden outputs",
    "diagnose": "localise where two models (or a model and a recorded trace) part",
    "record": "record a model's module-by-module trace for diagnose on another revision",
    "train": "train your model (--model) or a zoo case and judge its trajectory",
    "bench": "measure backend throughput, start-up and the cost of the safety net",
    "backends": "list attention backends and why each is or is not available here",
    "calibrate": "measure the tolerance model's false-alarm and detection rates",
    "twins": "check a refactored module against the original on drawn shapes, masks, dtypes",
}


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``) and return its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    # --debug is taken anywhere on the line, after a nested subcommand (golden update) too
    plain = [arg for arg in argv if arg != "--debug"]
    args = build_parser(plain).parse_args(plain)
    args.debug = len(plain) < len(argv)
    args._argv = argv  # a command run as several ranks starts itself again (--nproc)
    prog = f"torchparity {args.command}"
    try:
        command = importlib.import_module(args._module)  # torch and the rest imported
        from torchparity.ci.output_paths import check_output_paths

        check_output_paths(args)  # before any work, which may take minutes
        with older_objects_frozen():
            return _recorded(command.run(args))
    except KeyboardInterrupt as exc:
        print(f"{prog}: interrupted{_noted(exc, ': ')}", file=sys.stderr)
        return 130
    except TorchParityError as exc:
        status = getattr(exc, "exit_status", EXIT_USAGE)
        # An error that wraps the user's exception points at the user's code.
        origin = exc.__cause__ if status == EXIT_UNEXPECTED and exc.__cause__ else None
        label = getattr(exc, "label", "error")  # a finding says FAILED, as a failed check
        return _report(prog, f"{label}: {exc}", status, exc, origin, args.debug)
    except OSError as exc:  # a file that cannot be read or written
        return _report(prog, f"error: {exc}", EXIT_USAGE, exc, None, args.debug)
    except Exception as exc:
        return _report(prog, f"unexpected {type(exc).__name__}: {_first_line(exc)}",
                       EXIT_UNEXPECTED, exc, exc, args.debug)


def _report(prog: str, message: str, status: int, exc: BaseException,
            origin: BaseException | None, debug: bool) -> int:
    """Print the one-line error (naming the innermost frame of ``origin``, when given), after
    the traceback with ``--debug``; return ``status``."""
    if debug:
        traceback.print_exception(exc, file=sys.stderr)
    line = f"{prog}: {_failed_alone(exc)}{message}{_noted(exc)}"
    if origin is not None:
        line += f" (at {_innermost_frame(origin)})"
        if not debug:
            line += "; --debug shows the traceback"
    print(line, file=sys.stderr)
    return _recorded(status, line)


def _noted(exc: BaseException, separator: str = "; ") -> str:
    """The notes added to ``exc`` on its way out (what a golden folder holds after it), as the
    end of its line."""
    notes = getattr(exc, "__notes__", [])
    return separator + "; ".join(notes) if notes else ""


def _failed_alone(exc: BaseException) -> str:
    """``rank N: `` where this process is one of several ranks and may have failed alone
    (else nothing): it then leaves its group at once, and torchrun stops the other ranks,
    which would otherwise wait for it in their next collective."""
    from torchparity.distributed import group
    from torchparity.subject.slices import under_torchrun

    if not under_torchrun() or getattr(exc, "every_rank", False):
        return ""
    group.abandon()
    return f"rank {group.rank()}: " if group.world_size() > 1 else ""


def _recorded(status: int, line: str | None = None) -> int:
    """``status``, also left for the launcher when this process is one of several ranks that
    ``--nproc`` started (see :mod:`torchparity.distributed.launch`)."""
    from torchparity.subject.slices import under_torchrun

    if under_torchrun():  # torch is imported already: the launcher costs nothing more
        from torchparity.distributed.launch import record_outcome

        record_outcome(status, line)
    return status


def _innermost_frame(exc: BaseException) -> str:
    """``file:line`` of the innermost frame in the user's own code (else the innermost one):
    an error raised by torch inside the user's model points at the user's line that called
    torch, not at ``torch/_ops.py``."""
    # An exception from a worker process (concurrent.futures) carries the worker's traceback
    # as the text of its cause: the frame that raised is there, not where it was re-raised.
    remote = re.findall(r'File "([^"]+)", line (\d+)', str(exc.__cause__ or ""))
    if type(exc.__cause__).__name__ == "_RemoteTraceback" and remote:
        frames = [(path, int(line)) for path, line in remote]
    else:
        frames = [(f.filename, f.lineno) for f in traceback.extract_tb(exc.__traceback__)]
    if not frames:
        return "unknown location"
    path, line = next((frame for frame in reversed(frames) if _users(frame[0])), frames[-1])
    return f"{path}:{line}"


def _users(path: str) -> bool:
    """Whether ``path`` is the user's code: not Python's, an installed package's, nor
    torchparity's own."""
    if path.startswith("<"):
        return False
    resolved = str(Path(path).resolve())
    return not any(resolved.startswith(root) for root in _LIBRARY_ROOTS)


#: Where code that is not the user's lives: the standard library, installed packages and
#: torchparity itself.
_LIBRARY_ROOTS = tuple(dict.fromkeys(
    [str(Path(p).resolve()) + os.sep for p in
     (sysconfig.get_path("stdlib"), sysconfig.get_path("purelib"),
      sysconfig.get_path("platlib"), Path(__file__).parent)]))


def _first_line(exc: BaseException) -> str:
    lines = str(exc).splitlines()
    return lines[0] if lines else "(no message)"


class _Parser(argparse.ArgumentParser):
    """A parser whose usage errors are one line, naming the command, what is wrong and where
    the options are listed (argparse prints its whole usage block first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Build the parser, loading the arguments of the subcommand named in ``argv`` only."""
    parser = _Parser(
        prog="torchparity",
        description="Numerical-equivalence checks for PyTorch transformer code.",
        epilog=EXIT_STATUSES,
    )
    parser.add_argument("--version", action="version", version=f"torchparity {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an unexpected error (anywhere on the "
                             "line, after the command too)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, help_text in COMMANDS.items():
        cmd_parser = sub.add_parser(name, help=help_text, description=help_text)
        cmd_parser.set_defaults(_module=f"torchparity.commands.{name}")
        if name == chosen:
            importlib.import_module(f"torchparity.commands.{name}").add_arguments(cmd_parser)
    return parser


if __name__ == "__main__":
    sys.exit(main())
