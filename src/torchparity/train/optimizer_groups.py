"""An optimizer's parameter groups by meaning: which parameters (by name) each group holds,
and its hyper-parameters (lr, weight_decay, betas, eps, ...) as they stood at every step.

A golden trajectory stores this description of its run (a small JSON), so that a run that
parts from it can be told, before any norm is read, that a parameter changed group or a
hyper-parameter changed value (:func:`compare_groups`): per-group norms move when their
members do, and an update norm when the learning rate does, but neither says why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from torchparity import tolerance

#: Group keys that choose an implementation, not the mathematics of the update.
_IMPLEMENTATION = frozenset({"params", "name", "foreach", "fused", "capturable",
                             "differentiable"})

Value = float | bool | tuple[float, ...]


@dataclass
class OptimizerGroups:
    """The groups of one run: ``members`` maps each group's name to its parameters' names,
    ``hyper`` holds, per step (1-based, ``hyper[0]`` is step 1), each group's
    hyper-parameters as the optimizer held them when the step began."""

    members: dict[str, list[str]]
    hyper: list[dict[str, dict[str, Value]]] = field(default_factory=list)

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, model: torch.nn.Module,
           names: list[str]) -> OptimizerGroups:
        """The groups of ``optimizer`` (named ``names``), their parameters named as in
        ``model``."""
        named = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
        members = {group: [named.get(id(p), f"<parameter {i} of no module>")
                           for i, p in enumerate(g["params"])]
                   for group, g in zip(names, optimizer.param_groups, strict=True)}
        return cls(members)

    def record(self, optimizer: torch.optim.Optimizer) -> None:
        """Append the hyper-parameters the groups hold now: those of the step about to run."""
        self.hyper.append({name: _hyper(g)
                           for name, g in zip(self.members, optimizer.param_groups,
                                              strict=True)})

    def to_dict(self) -> dict[str, Any]:
        """Per group its parameters and hyper-parameters; a value the same at every step is
        stored once, one that changes as ``{"steps": [...]}``."""
        groups = []
        for name, params in self.members.items():
            keys = dict.fromkeys(k for step in self.hyper for k in step[name])
            hyper = {}
            for key in keys:
                values = [step[name].get(key) for step in self.hyper]
                same = all(v == values[0] for v in values)
                hyper[key] = _jsonable(values[0]) if same else {
                    "steps": [_jsonable(v) for v in values]}
            groups.append({"name": name, "params": params, "hyper": hyper})
        return {"steps": len(self.hyper), "groups": groups}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OptimizerGroups:
        """The inverse of :meth:`to_dict`."""
        steps = int(data["steps"])
        members = {g["name"]: list(g["params"]) for g in data["groups"]}
        hyper: list[dict[str, dict[str, Value]]] = [{} for _ in range(steps)]
        for group in data["groups"]:
            for step in range(steps):
                hyper[step][group["name"]] = {
                    key: _value(value["steps"][step] if isinstance(value, dict) else value)
                    for key, value in group["hyper"].items()}
        return cls(members, hyper)


@dataclass(frozen=True)
class GroupChange:
    """One difference between the groups of A and B: its sentence, the first step whose
    update it changes (a membership change: step 1), and whether it changed which
    parameters a group holds."""

    sentence: str
    step: int
    members: bool = False


def compare_groups(a: OptimizerGroups, b: OptimizerGroups, last_step: int
                   ) -> list[GroupChange]:
    """What differs between the groups of A and B up to ``last_step``, by meaning.

    Groups are paired by name; a parameter is followed by its name. Returned, in this order:
    groups only one run has, parameters that moved from one group to another (one change per
    pair of groups, every name listed), and per hyper-parameter the first step where a group's
    value differs (groups whose two values agree are named together).

    Args:
        a: the groups of the golden (or base) run.
        b: the groups of the run judged.
        last_step: the last step compared.

    Returns:
        The changes, empty when the groups agree.
    """
    changes = []
    only_a = [g for g in a.members if g not in b.members]
    only_b = [g for g in b.members if g not in a.members]
    if only_a or only_b:
        changes.append(GroupChange(
            f"the parameter groups differ: {_listing(list(a.members))} (A) vs "
            f"{_listing(list(b.members))} (B)", 1, members=True))
    group_a = {p: g for g, params in a.members.items() for p in params}
    group_b = {p: g for g, params in b.members.items() for p in params}
    moved: dict[tuple[str, str], list[str]] = {}
    for param, g in group_a.items():
        if param in group_b and group_b[param] != g:
            moved.setdefault((g, group_b[param]), []).append(param)
    for (source, target), params in moved.items():
        count = "1 parameter" if len(params) == 1 else f"{len(params)} parameters"
        changes.append(GroupChange(f"{count} moved from group {source} to {target}: "
                                   f"{', '.join(params)}", 1, members=True))
    changes += _hyper_changes(a, b, [g for g in a.members if g in b.members], last_step)
    return changes


def _hyper_changes(a: OptimizerGroups, b: OptimizerGroups, groups: list[str],
                   last_step: int) -> list[GroupChange]:
    found: dict[tuple[str, int, str, str], list[str]] = {}
    for group in groups:
        keys = dict.fromkeys(k for step in (*a.hyper, *b.hyper) for k in step.get(group, {}))
        for key in keys:
            for step in range(1, min(last_step, len(a.hyper), len(b.hyper)) + 1):
                value_a = a.hyper[step - 1][group].get(key)
                value_b = b.hyper[step - 1][group].get(key)
                if not _same(value_a, value_b):
                    shown = _shown(value_a, value_b)
                    found.setdefault((key, step, *shown), []).append(group)
                    break
    changes = []
    for (key, step, shown_a, shown_b), named in found.items():
        where = f" in group{'s' if len(named) > 1 else ''} {', '.join(named)}"
        changes.append(GroupChange(f"{key} at step {step}{where}: {shown_a} (A) vs "
                                   f"{shown_b} (B)", step))
    return sorted(changes, key=lambda c: c.step)


def _hyper(group: dict[str, Any]) -> dict[str, Value]:
    """The group's hyper-parameters: numbers, flags and tuples of numbers (a tensor lr as a
    float); implementation choices and anything else left out."""
    out: dict[str, Value] = {}
    for key, value in group.items():
        if key in _IMPLEMENTATION:
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool | int | float):
            out[key] = value if isinstance(value, bool) else float(value)
        elif isinstance(value, tuple | list) and all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            out[key] = tuple(float(v) for v in value)
    return out


def _same(a: Value | None, b: Value | None) -> bool:
    """Equal values, numbers within the rounding a refactor of their arithmetic makes
    (:data:`~torchparity.tolerance.HYPERPARAMETER_RTOL`)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a == b
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=tolerance.HYPERPARAMETER_RTOL, abs_tol=0.0)
    return False


def _shown(a: Value | None, b: Value | None) -> tuple[str, str]:
    """Both values with the fewest significant digits that tell them apart."""
    for digits in range(4, 18):
        shown = _format(a, digits), _format(b, digits)
        if shown[0] != shown[1]:
            return shown
    return _format(a, 17), _format(b, 17)


def _format(value: Value | None, digits: int) -> str:
    if value is None:
        return "not set"
    if isinstance(value, tuple):
        return "(" + ", ".join(_format(v, digits) for v in value) + ")"
    if isinstance(value, bool):
        return str(value)
    return f"{value:.{digits}g}"


def _listing(names: list[str]) -> str:
    return ", ".join(names) if names else "no groups"


def _jsonable(value: Value | None) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _value(stored: Any) -> Value:
    return tuple(stored) if isinstance(stored, list) else stored
