"""The ``torchparity`` command.

Each subcommand lives in ``torchparity.commands.<name>`` and provides ``add_arguments(parser)``
and ``run(args) -> int``; they are imported only when used so ``torchparity --help`` is instant.
Exit codes: 0 success, 1 a check failed, 2 a usage or file error, 3 the user's own code (a
model factory) raised; errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from torchparity.errors import TorchParityError

COMMANDS = {
    "check": "compare the reference zoo with the shipped goldens on every backend and dtype",
    "golden": "create, verify or show golden outputs",
    "diagnose": "localise where two models (or a model and a recorded trace) part",
    "record": "record a model's module-by-module trace for diagnose on another revision",
    "train": "run training steps of a zoo case and report or compare the trajectory",
    "bench": "measure backend throughput, start-up and the cost of the safety net",
    "backends": "list attention backends and why each is or is not available here",
    "calibrate": "measure the tolerance model's false-alarm and detection rates",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    try:
        return importlib.import_module(args._module).run(args)
    except TorchParityError as exc:
        print(f"torchparity {args.command}: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_status", 2)
    except KeyboardInterrupt:
        print(f"torchparity {args.command}: interrupted", file=sys.stderr)
        return 130


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    """Build the parser, loading the arguments of the subcommand named in ``argv`` only."""
    parser = argparse.ArgumentParser(
        prog="torchparity",
        description="Numerical-equivalence checks for PyTorch transformer code.",
    )
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
