"""Users' models as *factories*: an entry ``file.py:name`` or ``package.module:name``.

The named callable returns ``(model, inputs)`` or ``(model, inputs, loss_fn)``, or a dict with
the keys ``model``, ``inputs`` and optionally ``loss_fn``, ``step``, ``decode`` and
``padding``. ``inputs`` is a tuple of positional arguments, a dict of keyword arguments or one
tensor; ``loss_fn(output, inputs)`` returns a scalar; ``step(model, tokens, state) -> (logits,
state)`` is one decoding step (:mod:`torchparity.subject.decoding`); ``decode(model, inputs,
use_cache)`` runs the model's incremental decoding and returns its outputs (a pytree of
tensors); ``padding`` says which positions are padding where the inputs do not (see
:mod:`torchparity.subject.padding`); ``parallelize(model, mesh)`` shards the model in place
over a device mesh (its FSDP2 ``fully_shard`` / ``parallelize_module`` plan) and ``mesh`` is the
mesh it wants, ``{"dp": -1, "tp": 2}`` (one size may be -1: the ranks left), both read under
torchrun only (:mod:`torchparity.distributed.sharding`); ``shards`` says, of a model a factory
sharded by hand under torchrun (plain per-rank slices), which dimension each sliced parameter
is split along (:mod:`torchparity.distributed.slices`); ``init(model)`` fills the weights of a
model the factory built on the meta device, once it is materialised (under torchrun: sharded
first, each rank filling its part only). Training (``torchparity train --model``, see
:mod:`torchparity.train.user_model`) reads ``batches(step) -> inputs`` (the inputs of optimizer
step ``step``, 1-based, deterministic), ``optimizer(model) -> torch.optim.Optimizer`` (the
user's param groups), optionally ``scheduler(optimizer)`` (stepped after every optimizer step)
and ``train_step(model, batch, optimizer) -> loss`` (the user's own step). A file imports as
``python file.py`` would run it: its folder comes first on ``sys.path``, so modules beside it
import.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from torchparity.errors import UsageError, UserCodeError
from torchparity.subject import hf_families
from torchparity.text import with_article

#: The keys a factory's dict may have; the first two are required.
KEYS = ("model", "inputs", "loss_fn", "step", "decode", "padding", "reorder", "search",
        "parallelize", "mesh", "init", "shards", "batches", "optimizer", "scheduler",
        "train_step")


def resolve_entry(spec: str) -> Callable[..., Any]:
    """The callable an entry names, imported but not called.

    Args:
        spec: ``package.module:name``, ``path/to/file.py:name`` or an ``hf:`` entry
            (:mod:`~torchparity.subject.hf_families`).

    Returns:
        The factory.

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
    """A factory's name as reports and golden folders use it, without the file's folder.

    Args:
        spec: ``path/to/models.py:gpt2``, ``pkg.mod:gpt2`` or ``hf:gpt2,attn=eager``.

    Returns:
        ``models.gpt2``, ``pkg.mod.gpt2`` or ``hf.gpt2.eager``.
    """
    if hf_families.is_hf_entry(spec):
        return hf_families.parse(spec).name
    location, _, attribute = spec.rpartition(":")
    stem = Path(location).stem if location.endswith(".py") else location
    return f"{stem}.{attribute}"


def call_factory(factory: Callable[[], object], label: str) -> dict[str, Any]:
    """Call ``factory`` and check what it returns, so a mistake is named before any run.

    Args:
        factory: the user's factory.
        label: the factory's name in messages.

    Returns:
        Every key of :data:`KEYS` (absent ones None).

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
    """The first line of an exception's message, for one-line errors.

    Args:
        exc: the exception.

    Returns:
        Its message's first line, or ``(no message)``.
    """
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
    """Import ``path`` as ``python path`` runs it: its folder first on ``sys.path`` (it stays
    there, as for a script, so the factory's later imports find its neighbours too)."""
    if not path.is_file():
        raise UsageError(f"entry point {spec}: no file {path}")
    folder = str(path.resolve().parent)
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[path.stem] = module
    module_spec.loader.exec_module(module)
    return module
