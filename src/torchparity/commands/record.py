"""``torchparity record``: write a model's module-by-module trace on the base revision.

The model comes from an entry point ``package.module:factory`` (or ``path/to/file.py:factory``)
whose factory returns ``(model, inputs)`` or ``(model, inputs, loss_fn)``; ``inputs`` is a
tuple of positional or a dict of keyword arguments.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from torch import nn

from torchparity.errors import UsageError


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


def run(args: argparse.Namespace) -> int:
    from torchparity.diagnosis.api import record

    model, inputs, loss_fn = load_entry(args.entry)
    path = record(model, inputs, args.output, loss_fn=loss_fn, backward=args.backward,
                  include=args.include, exclude=args.exclude, backend=args.backend)
    print(f"recorded {type(model).__name__} to {path}")
    return 0


def load_entry(spec: str) -> tuple[nn.Module, Any, Any]:
    """Import ``module:factory`` (module path or .py file), call it, check what it returns.

    Returns ``(model, inputs, loss_fn or None)``; every problem is a one-line UsageError.
    """
    location, _, attribute = spec.rpartition(":")
    if not location or not attribute:
        raise UsageError(f"entry point {spec!r} must look like package.module:factory or "
                         "path/to/file.py:factory")
    module = _import_location(location, spec)
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise UsageError(f"entry point {spec}: {location} has no callable {attribute!r}")
    result = factory()
    if not (isinstance(result, tuple) and len(result) in (2, 3)):
        raise UsageError(f"entry point {spec} must return (model, inputs) or "
                         f"(model, inputs, loss_fn); it returned {type(result).__name__}")
    model, inputs, loss_fn = (*result, None) if len(result) == 2 else result
    if not isinstance(model, nn.Module):
        raise UsageError(f"entry point {spec} returned a {type(model).__name__} as model, "
                         "not a torch.nn.Module")
    return model, inputs, loss_fn


def _import_location(location: str, spec: str) -> Any:
    try:
        if location.endswith(".py"):
            path = Path(location)
            if not path.is_file():
                raise UsageError(f"entry point {spec}: no file {location}")
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[path.stem] = module
            module_spec.loader.exec_module(module)
            return module
        if "" not in sys.path:  # like `python -m`: modules in the working directory import
            sys.path.insert(0, "")
        return importlib.import_module(location)
    except ImportError as exc:
        raise UsageError(f"entry point {spec}: cannot import {location} ({exc})") from None
