"""``torchparity twins OLD NEW --inputs SPEC``: two implementations of a module checked
against each other on drawn inputs (docs/twins.md)."""

from __future__ import annotations

import argparse

from torchparity.backends import names as backend_names
from torchparity.dtypes import CASTABLE, dtype_name
from torchparity.twins.strategies import MASKS

AS_WRITTEN = "none"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("old", help="the original: file.py:Name or package.module:Name, a class "
                                    "or a factory of the module")
    parser.add_argument("new", help="the refactor, named the same way")
    parser.add_argument("--inputs", required=True, metavar="SPEC",
                        help="'attention' (hidden_states and a mask, drawn), 'decoding' "
                             "(steps of hidden_states with a cache), or file.py:name, a "
                             "function of the constructor arguments returning the inputs "
                             "(a tuple or dict: one check) or a strategy of them (a search)")
    parser.add_argument("--init", action="append", default=[], metavar="NAME=VALUE",
                        help="a constructor argument, a Python literal; NAME=1,2,4 draws from "
                             "the values (repeatable)")
    parser.add_argument("--dtype", action="append", type=dtype_name, choices=CASTABLE,
                        help="dtype of the candidate (repeatable, drawn from; default fp32)")
    parser.add_argument("--backend", action="append", choices=[AS_WRITTEN, *backend_names()],
                        metavar="NAME",
                        help=f"attention backend of the candidate: {AS_WRITTEN} (the module as "
                             f"written), {', '.join(backend_names())} (repeatable, drawn "
                             f"from; default {AS_WRITTEN})")
    parser.add_argument("--weight-map", metavar="ENTRY",
                        help="file.py:name of a function from the old state_dict to the new "
                             "one (default: the same names)")
    parser.add_argument("--cache", action="append", default=[], metavar="ENTRY",
                        help="cache factory of a decoding twin, passed as cache=; give it "
                             "twice for the old side's and the new side's")
    parser.add_argument("--mask", default="key-padding", choices=MASKS, metavar="KIND",
                        help=f"mask convention of --inputs attention: {', '.join(MASKS)} "
                             f"(default key-padding)")
    parser.add_argument("--positions", metavar="LO,HI",
                        help="--inputs attention also passes position_ids from an offset "
                             "drawn in [LO, HI]")
    parser.add_argument("--examples", type=int, default=100, metavar="N",
                        help="examples of a search (default 100)")
    parser.add_argument("--seed", type=int, default=0,
                        help="weight seed of a single check (default 0)")


def run(args: argparse.Namespace) -> int:
    from torchparity.errors import UsageError
    from torchparity.twins import TwinFailure, shell

    positions = None
    if args.positions:
        try:
            low, high = (int(v) for v in args.positions.split(","))
        except ValueError:
            raise UsageError(f"--positions {args.positions!r}: write LO,HI (0,4096)") from None
        positions = (low, high)
    backends = [None if b == AS_WRITTEN else b for b in args.backend or [AS_WRITTEN]]
    try:
        options = shell.twin_options(shell.parse_init(args.init), args.weight_map, args.cache,
                                     args.seed)
        line = shell.run_twins(args.old, args.new,
                               shell.InputsSpec(args.inputs, args.mask, positions), options,
                               dtypes=args.dtype or ["fp32"], backends=backends,
                               examples=args.examples)
    except TwinFailure as failure:
        print(failure)
        return 1
    print(line)
    return 0
