"""A standalone script that rebuilds both implementations and reruns a failing twin check.

Classes, factories, weight-map functions and cache factories are named by their file and
name (``path/to/file.py:Name``, loaded as ``torchparity check --model`` loads factories), so
the script runs from any folder while the file is there; tensors are written out in full.
Objects the script cannot rebuild (a module instance, a lambda, a function defined inside
another) are named in one line instead of the script.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from torchparity.twins.running import Steps

HEADER = """\
import torch
import torchparity as tp
from torchparity.subject.factory import resolve_entry
from torchparity.twins import Steps
"""


class NotRebuildable(ValueError):
    """An argument of the check that a script cannot name."""


def entry(obj: Any, label: str) -> str:
    """``path/to/file.py:Name`` of a class or function defined at the top of a file."""
    if isinstance(obj, torch.nn.Module):
        raise NotRebuildable(f"the {label} is a module instance; pass its class or a factory "
                             f"(with init=) to get a reproducer")
    name = getattr(obj, "__qualname__", "")
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:  # a builtin, a functools.partial, an instance with __call__
        path = None
    if not name or "<" in name or "." in name or path is None:
        raise NotRebuildable(f"the {label} {name or obj!r} is not defined at the top of a file; "
                             "define it there to get a reproducer")
    return f"{path}:{name}"


def script(old: Any, new: Any, inputs: Any, options: dict[str, Any]) -> str:
    """The script's text; :class:`NotRebuildable` when some argument cannot be named."""
    from torchparity.strategies import python_source  # hypothesis: only to write a script

    lines = [HEADER, f"old = resolve_entry({entry(old, 'old implementation')!r})",
             f"new = resolve_entry({entry(new, 'new implementation')!r})"]
    arguments = []
    for name, value in options.items():
        if value is None or (name in ("seed", "grads") and value in (0, True)):
            continue  # the defaults
        if name == "weight_map" and callable(value):
            lines.append(f"weight_map = resolve_entry({entry(value, 'weight map')!r})")
        elif name == "cache":
            pair = value if isinstance(value, tuple) else (value,)
            named = [f"resolve_entry({entry(f, 'cache factory')!r})" for f in pair]
            lines.append(f"cache = {named[0] if len(named) == 1 else '(' + ', '.join(named) + ')'}")
        else:
            lines.append(f"{name} = {python_source(value)}")
        arguments.append(name)
    lines.append(f"inputs = {_inputs_source(inputs)}")
    call = ", ".join(["old", "new", "inputs", *(f"{n}={n}" for n in arguments)])
    lines.append(f"tp.assert_twins({call})")
    return "\n".join(lines) + "\n"


def _inputs_source(inputs: Any) -> str:
    from torchparity.strategies import python_source

    if isinstance(inputs, Steps):
        return f"Steps({python_source(list(inputs))})"
    return python_source(inputs)


def section(old: Any, new: Any, inputs: Any, options: dict[str, Any]) -> str:
    """The reproducer as a failure message shows it, or the line saying why there is none."""
    try:
        text = script(old, new, inputs, options)
    except NotRebuildable as exc:
        return f"No reproducer: {exc}."
    return ("Reproducer (a standalone script; save it and run it with python):\n"
            + "# --- reproducer ---\n" + text + "# --- end of reproducer ---")
