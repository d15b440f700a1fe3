"""A library module's ops placed in the user's code: the line that calls it, the line that
builds it.

An ``nn.LayerNorm``'s ops run in torch's code, yet they tell the change (``eps 1e-05 (A) vs
0.001 (B)``): they take the line of the caller's forward that calls it, and where it was
built is read from the owner's ``__init__`` source (a model arrives built, before any hook
could watch it), only when a drill-down needs it."""

from __future__ import annotations

import ast
import inspect
import textwrap

from torch import nn

from torchparity.diagnosis.stages.ops.capture import Frame, Step, display_path
from torchparity.diagnosis.stages.ops.judge import OpLine
from torchparity.diagnosis.stages.ops.report import OpReport

__all__ = ["built_at", "holds_other_tensors", "in_callers_code"]


def holds_other_tensors(found: OpReport) -> bool:
    """Whether ``found``'s answer is an op reading only tensors no op made, whose local error
    agrees: B's module holds other values (weights its caller chose), not other code."""
    line = found.answer
    return line is not None and line.pair.kind == "paired" and \
        (line.local is None or line.local.ok) and \
        all(p is None for p in line.pair.b.producers)


def in_callers_code(found: OpReport, caller: OpReport, calls: dict[str, str], nth: int,
                    built: dict[str, Frame | None]) -> OpReport | None:
    """``found`` with each side's ops at the line of ``caller`` that makes its ``nth`` call of the
    module (``calls``: each side's name of it), and where each built it; None without such a
    call (a backward pass)."""
    stacks = {}
    for side, name in calls.items():
        made = [step for line in caller.lines if (step := _side(line, side)) is not None
                and step.kind == "module" and step.name == name]
        if made:
            stacks[side] = made[min(nth, len(made) - 1)].stack
    if not stacks:
        return None
    for line in found.lines:
        for side, stack in stacks.items():
            if (step := _side(line, side)) is not None:
                step.stack = step.stack + stack
    found.built = {side: frame for side, frame in built.items() if frame is not None}
    return found


def built_at(model: nn.Module, name: str) -> Frame | None:
    """The line that builds module ``name``: the assignment in its owner's ``__init__`` (a
    container's owner for an ``nn.ModuleList``); None when no source says it."""
    *path, attribute = name.split(".")
    try:
        owner = model.get_submodule(".".join(path))
        while path and type(owner).__module__.startswith("torch."):  # a container's element
            attribute = path.pop()
            owner = model.get_submodule(".".join(path))
    except AttributeError:  # a name the model does not hold (a module it swapped in)
        return None
    for cls in type(owner).__mro__:
        if "__init__" in vars(cls) and not cls.__module__.startswith("torch."):
            frame = _assignment(vars(cls)["__init__"], attribute)
            if frame is not None:
                return frame
    return None


def _side(line: OpLine, side: str) -> Step | None:
    return line.pair.a if side == "A" else line.pair.b


def _assignment(init: object, attribute: str) -> Frame | None:
    """The last line of ``init`` that assigns ``self.<attribute>`` (the one that stands)."""
    try:
        lines, start = inspect.getsourcelines(init)
        path = inspect.getsourcefile(init)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    found = None
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(_is_self_attribute(t, attribute) for t in _flat(targets)):
            if found is None or node.lineno > found:
                found = node.lineno
    if found is None or path is None:
        return None
    return Frame(display_path(path), start + found - 1, lines[found - 1].strip())


def _flat(targets: list[ast.expr]) -> list[ast.expr]:
    """Assignment targets with tuples unpacked (``self.up, self.norm = ...``)."""
    out = []
    for target in targets:
        out += _flat(target.elts) if isinstance(target, ast.Tuple | ast.List) else [target]
    return out


def _is_self_attribute(target: ast.expr, attribute: str) -> bool:
    return isinstance(target, ast.Attribute) and target.attr == attribute and \
        isinstance(target.value, ast.Name) and target.value.id == "self"
