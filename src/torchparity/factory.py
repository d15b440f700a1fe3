"""Users' models as *factories*: an entry ``file.py:name`` or ``package.module:name``.

The named callable returns ``(model, inputs)`` or ``(model, inputs, loss_fn)``; ``inputs`` is a
tuple of positional arguments, a dict of keyword arguments or one tensor. Every command that
takes a user's model (``check``, ``golden``, ``bench``, ``diagnose``, ``record``) loads it here.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from torch import nn

from torchparity.errors import UsageError


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
