"""Users' models as *factories*: an entry ``file.py:name``, ``package.module:name``, ``hf:FAMILY``.

The callable returns ``(model, inputs[, loss_fn])`` or a dict of :data:`KEYS`; docs/your-model.md
says what each key means.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from torchparity.errors import UsageError, UserCodeError
from torchparity.subject import hf_families
from torchparity.text import with_article

#: The keys a factory's dict may have; the first two are required.
KEYS = ("model", "inputs", "loss_fn", "step", "decode", "padding", "reorder", "search",
        "parallelize", "mesh", "init", "shards", "batches", "optimizer", "scheduler",
        "train_step")


def resolve_entry(spec: str) -> Callable[..., object]:
    """The callable an entry names, imported but not called.

    Raises:
        UsageError: the entry is malformed, does not import, or names no callable.
        UserCodeError: importing the user's module raised.
    """
    if hf_families.is_hf_entry(spec):
        return hf_families.factory(spec)
    location, _, attribute = spec.rpartition(":")
    if not location or not attribute:
        raise UsageError(f"entry point {spec!r} must look like package.module:factory, "
                         "path/to/file.py:factory or hf:FAMILY")
    module = _import_location(location, spec)
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise UsageError(f"entry point {spec}: {location} has no callable {attribute!r}")
    return factory


def entry_name(spec: str) -> str:
    """A factory's name in reports and golden folders: ``models.gpt2``, ``hf.gpt2.eager``."""
    if hf_families.is_hf_entry(spec):
        return hf_families.parse(spec).name
    location, _, attribute = spec.rpartition(":")
    stem = Path(location).stem if location.endswith(".py") else location
    return f"{stem}.{attribute}"


def call_factory(factory: Callable[[], object], label: str) -> dict[str, object]:
    """Call ``factory`` and check what it returns: every key of :data:`KEYS`, absent ones None.

    Raises:
        UsageError: what it returns has the wrong form, keys or types (one line).
        UserCodeError: the factory raised.
    """
    try:
        result = factory()
    except UsageError:  # an hf: entry's own refusal
        raise
    except Exception as exc:
        raise UserCodeError(f"factory {label} raised {type(exc).__name__}: "
                            f"{first_line(exc)}") from exc
    if isinstance(result, Mapping):
        unknown = sorted(set(result) - set(KEYS))
        if unknown or not {"model", "inputs"} <= set(result):
            raise UsageError(f"factory {label} returned a dict with keys "
                             f"{', '.join(map(str, result)) or '(none)'}; it needs 'model' and "
                             f"'inputs' and may have 'loss_fn', 'step', 'reorder', 'search', "
                             "'decode', 'padding', 'parallelize', 'mesh', 'init', 'shards', "
                             "'batches', 'optimizer', 'scheduler' and 'train_step'")
        fields = {key: result.get(key) for key in KEYS}
    elif isinstance(result, tuple) and len(result) in (2, 3):
        fields = {**dict.fromkeys(KEYS), **dict(zip(KEYS, result, strict=False))}
    else:
        raise UsageError(f"factory {label} must return (model, inputs) or "
                         f"(model, inputs, loss_fn); it returned {_describe(result)}")
    if not isinstance(fields["model"], nn.Module):
        kind = with_article(type(fields["model"]).__name__)
        raise UsageError(f"factory {label} returned {kind} as model, not a torch.nn.Module")
    if not isinstance(fields["inputs"], tuple | Mapping | torch.Tensor):
        raise UsageError(f"factory {label} returned inputs of type "
                         f"{type(fields['inputs']).__name__}; give a tuple of positional "
                         "arguments, a dict of keyword arguments or one tensor")
    for key in ("loss_fn", "step", "reorder", "decode", "parallelize", "init", "batches",
                "optimizer", "scheduler", "train_step"):
        value = fields[key]
        if value is not None and not callable(value):
            kind = with_article(type(value).__name__)
            raise UsageError(f"factory {label} returned {kind} as {key}; it must be callable")
    return fields


def _describe(result: object) -> str:
    if isinstance(result, tuple):
        return f"a tuple of {len(result)}"
    return "None" if result is None else with_article(type(result).__name__)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or ``(no message)``."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else "(no message)"


def _import_location(location: str, spec: str) -> ModuleType:
    try:
        if location.endswith(".py"):
            return _import_file(Path(location), spec)
        if "" not in sys.path:  # like `python -m`: modules in the working directory import
            sys.path.insert(0, "")
        return importlib.import_module(location)
    except ImportError as exc:
        raise UsageError(f"entry point {spec}: cannot import {location} ({exc})") from None
    except UsageError:
        raise
    except Exception as exc:
        raise UserCodeError(f"entry point {spec}: importing {location} raised "
                            f"{type(exc).__name__}: {first_line(exc)}") from exc


def _import_file(path: Path, spec: str) -> ModuleType:
    """Import ``path`` as ``python path`` runs it: its folder stays first on ``sys.path``."""
    if not path.is_file():
        raise UsageError(f"entry point {spec}: no file {path}")
    folder = str(path.resolve().parent)
    # as for a script, so the factory's later imports find its neighbours too
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module
    module_spec.loader.exec_module(module)
    return module
