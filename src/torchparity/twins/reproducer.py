"""A standalone script that rebuilds both implementations and reruns a failing twin check.

Classes and functions are named by file and name, loaded as factories are; tensors are written in
full; module instances are saved with the inputs in a folder beside it; what it cannot rebuild (a
lambda, a nested function) is named in one line instead of the script.
"""

from __future__ import annotations

import inspect
import sys
import tempfile
from pathlib import Path

import torch

from torchparity.twins.running import Steps

HEADER = """\
import torch
import torchparity as tp
from torchparity.subject.factory import resolve_entry
from torchparity.twins import Steps
"""


#: The file beside the script that holds the saved module instances and inputs.
SAVED = "twins.pt"


class NotRebuildable(ValueError):
    """An argument of the check that a script cannot name."""


def entry(obj: object, label: str) -> str:
    """``path/to/file.py:Name`` of a class or function defined at the top of a file."""
    name = getattr(obj, "__qualname__", "")
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:  # a builtin, a functools.partial, an instance with __call__
        path = None
    if not name or "<" in name or "." in name or path is None:
        raise NotRebuildable(f"the {label} {name or obj!r} is not defined at the top of a file; "
                             "define it there to get a reproducer")
    return f"{path}:{name}"


def script(old: object, new: object, inputs: object, options: dict[str, object],
           saved: Path | None = None) -> str:
    """The script (``NotRebuildable`` where something cannot be named); modules in ``saved``."""
    from torchparity.strategies import python_source  # hypothesis: only to write a script

    lines = [HEADER]
    if saved is not None:
        objects = {side: obj for side, obj in (("old", old), ("new", new))
                   if isinstance(obj, torch.nn.Module)}
        tensors = {k: v for k, v in options.items() if isinstance(v, torch.Tensor)}
        torch.save({**objects, **tensors, "inputs": inputs}, saved / SAVED)
        lines += ["import sys", "from pathlib import Path", "",
                  f"sys.path[:0] = {_import_roots(objects.values())!r}  # the classes' modules",
                  f"saved = torch.load(Path(__file__).with_name({SAVED!r}), "
                  "weights_only=False)"]
    for side, label in (("old", "old implementation"), ("new", "new implementation")):
        obj = old if side == "old" else new
        lines.append(f"{side} = saved[{side!r}]" if isinstance(obj, torch.nn.Module) else
                     f"{side} = resolve_entry({entry(obj, label)!r})")
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
        elif saved is not None and isinstance(value, torch.Tensor):
            lines.append(f"{name} = saved[{name!r}]")
        else:
            lines.append(f"{name} = {python_source(value)}")
        arguments.append(name)
    lines.append("inputs = saved['inputs']" if saved is not None else
                 f"inputs = {_inputs_source(inputs)}")
    call = ", ".join(["old", "new", "inputs", *(f"{n}={n}" for n in arguments)])
    lines.append(f"tp.assert_twins({call})")
    return "\n".join(lines) + "\n"


def _inputs_source(inputs: object) -> str:
    from torchparity.strategies import python_source

    if isinstance(inputs, Steps):
        return f"Steps({python_source(list(inputs))})"
    return python_source(inputs)


def section(old: object, new: object, inputs: object, options: dict[str, object]) -> str:
    """The reproducer as a failure message shows it, or the line saying why there is none."""
    instances = any(isinstance(side, torch.nn.Module) for side in (old, new))
    try:
        if not instances:
            text = script(old, new, inputs, options)
            return ("Reproducer (a standalone script; save it and run it with python):\n"
                    + "# --- reproducer ---\n" + text + "# --- end of reproducer ---")
        folder = Path(tempfile.mkdtemp(prefix="torchparity-twins-"))
        text = script(old, new, inputs, options, saved=folder)
    except NotRebuildable as exc:
        return f"No reproducer: {exc}."
    path = folder / "reproduce.py"
    path.write_text(text)
    return (f"Reproducer (the modules and inputs saved beside it):\n  python {path}\n"
            + "# --- reproducer ---\n" + text + "# --- end of reproducer ---")


def _import_roots(modules: object) -> list[str]:
    """The folders first on ``sys.path`` so that pickled ``modules``' classes import by name."""
    roots = []
    for module in modules:
        for cls in {type(m) for m in module.modules()}:
            source = getattr(sys.modules.get(cls.__module__), "__file__", None)
            if source is None or cls.__module__.split(".")[0] in ("torch", "torchparity"):
                continue
            depth = cls.__module__.count(".") + (Path(source).name == "__init__.py")
            roots.append(str(Path(source).resolve().parents[depth]))
    return list(dict.fromkeys(roots))
