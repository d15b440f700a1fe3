"""``torchparity record``: write a model's module-by-module trace on the base revision.

The model comes from an entry point ``package.module:factory`` (or ``path/to/file.py:factory``),
see :class:`torchparity.subject.Subject`.
"""

from __future__ import annotations

import argparse

import torch

from torchparity.commands.common import dtype_name
from torchparity.subject import Subject


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("entry", help="package.module:factory or file.py:factory returning "
                                      "(model, inputs) or (model, inputs, loss_fn)")
    parser.add_argument("-o", "--output", required=True, metavar="PATH",
                        help="trace directory to write (replaced if it is a trace)")
    add_selection_arguments(parser)
    parser.add_argument("--backend", help="attention backend to run the model under")


def add_selection_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared with ``torchparity diagnose``."""
    parser.add_argument("--no-backward", dest="backward", action="store_false",
                        help="compare forward outputs only (no gradients)")
    parser.add_argument("--include", action="append", metavar="PATTERN",
                        help="only modules matching this glob (or 're:REGEX'); repeatable")
    parser.add_argument("--exclude", action="append", metavar="PATTERN",
                        help="skip modules matching this glob (or 're:REGEX'); repeatable")
    parser.add_argument("--dtype", type=dtype_name, choices=tuple(DTYPES),
                        help="run copies of the models in this dtype (fp64: compare A and B in "
                             "float64, where changes below fp32 noise show); default: as given")


#: ``--dtype`` choices of diagnose and record.
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16,
          "fp16": torch.float16}


def dtype_option(args: argparse.Namespace) -> torch.dtype | None:
    """The torch dtype ``--dtype`` names (None when not given)."""
    return DTYPES[args.dtype] if args.dtype else None


def run(args: argparse.Namespace) -> int:
    from torchparity.diagnosis.api import record

    subject = Subject.load(args.entry)
    path = record(subject.model, subject.inputs, args.output, loss_fn=subject.loss_fn,
                  backward=args.backward, include=args.include, exclude=args.exclude,
                  backend=args.backend, dtype=dtype_option(args), padding=subject.padding)
    print(f"recorded {type(subject.model).__name__} to {path}")
    return 0
