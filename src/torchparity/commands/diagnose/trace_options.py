"""The options of the commands that write or read a trace, ``record`` and ``diagnose``: which
modules and dtype, the names of A's modules in B, and the ``record`` options that reproduce
them on a base revision (``diagnose --base``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from torchparity.commands.common import dtype_name
from torchparity.dtypes import CASTABLE, torch_dtype
from torchparity.subject import Subject


def add_selection_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared with ``torchparity diagnose``."""
    parser.add_argument("--no-backward", dest="backward", action="store_false",
                        help="forward outputs only, no gradients (a decoding never takes "
                             "any)")
    parser.add_argument("--include", action="append", metavar="PATTERN",
                        help="only modules matching this glob (or 're:REGEX'); repeatable")
    parser.add_argument("--exclude", action="append", metavar="PATTERN",
                        help="skip modules matching this glob (or 're:REGEX'); repeatable")
    parser.add_argument("--dtype", type=dtype_name, choices=CASTABLE,
                        help="run copies of the models in this dtype (fp64: A and B in float64, "
                             "where changes below fp32 noise show); default: as given")


def dtype_option(args: argparse.Namespace) -> torch.dtype | None:
    """The torch dtype ``--dtype`` names (None when not given)."""
    return torch_dtype(args.dtype) if args.dtype else None


def rebuild_of(entry: str):
    """``rebuild()`` for a golden of the model of ``entry``: the factory called again."""
    return lambda: Subject.load(entry).model


def record_options(args: argparse.Namespace) -> tuple[list[str], tuple[str, ...]]:
    """``torchparity record``'s options for A's side, and the input files they name."""
    options = [] if args.backward else ["--no-backward"]
    for flag, values in (("--include", args.include), ("--exclude", args.exclude)):
        options += [arg for value in values or [] for arg in (flag, value)]
    for flag, value in (("--backend", args.backend_a), ("--dtype", args.dtype),
                        ("--steps", args.steps), ("--beams", args.beams),
                        ("--length-penalty", args.length_penalty), ("--eos", args.eos),
                        ("--temperature", args.temperature), ("--top-k", args.top_k),
                        ("--top-p", args.top_p), ("--seed", args.seed)):
        if value is not None:
            options += [flag, str(value)]
    files = (str(Path(args.tokens).resolve()),) if args.tokens else ()
    options += ["--tokens", files[0]] if files else []
    options += ["--sample"] if args.sample else []
    return options + (["--decode"] if args.decode else []), files
