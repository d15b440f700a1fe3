"""State a module reads besides its arguments' values: caches and other tensors it keeps.

Two places hold such state: the module itself (its buffers and the tensors it keeps as
attributes, ``self.k_cache`` or a ``layer_cache`` dict, in it and in its submodules), and
objects handed to it whose tensors are not compared as arguments (a ``KVCache`` in an
attention context, a ``transformers`` ``DynamicCache``). A decoding step reads both.

:func:`held_state` summarises each such tensor after a call: its shape and, per dimension, how
far it is written (:class:`Held`): a cache preallocated in chunks is judged by the positions it
holds, not by its capacity, and a slot inside that was never written (all zeros) is named.
:func:`state_difference` says where A's and B's differ, which is where a change enters a
module whose arguments agree.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchparity.subject.trees import walk

#: How deep attributes are followed into plain objects, dicts, lists and tuples.
_DEPTH = 6
#: How many never-written slots of one dimension are named.
_HOLES = 8


@dataclass(frozen=True)
class Held:
    """One state tensor after a call: its shape, the extent written along each dimension (one
    past the last slice that is not all zeros) and the slices below it that are all zeros."""

    shape: tuple[int, ...]
    extent: tuple[int, ...]
    holes: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Held:
        nonzero = tensor.detach().ne(0)
        extent, holes = [], {}
        for dim, size in enumerate(tensor.shape):
            written = nonzero.movedim(dim, 0).reshape(size, -1).any(1) if size else nonzero
            found = written.nonzero()
            end = int(found[-1]) + 1 if found.numel() else 0
            extent.append(end)
            gaps = (~written[:end]).nonzero().flatten()[:_HOLES].tolist() if end else []
            if gaps:
                holes[dim] = tuple(gaps)
        return cls(tuple(tensor.shape), tuple(extent), holes)

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "extent": list(self.extent),
                "holes": {str(d): list(h) for d, h in self.holes.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Held:
        return cls(tuple(data["shape"]), tuple(data["extent"]),
                   {int(d): tuple(h) for d, h in data["holes"].items()})


def held_state(module: nn.Module, args: tuple, kwargs: dict) -> dict[str, Held]:
    """The state ``module`` reads, summarised: ``state.<attribute path>`` for what it (or a
    submodule) keeps, and ``args.<i>.<path>`` / ``kwargs.<name>.<path>`` for the tensors inside
    objects it was handed (the paths an argument's tensors would have)."""
    held = {f"state.{path}": Held.of(t) for path, t in kept_tensors(module)}
    for path, leaf in [*walk(args, "args"), *walk(kwargs, "kwargs")]:
        if not isinstance(leaf, torch.Tensor) and _is_object(leaf):
            held.update({f"{path}.{inner}": Held.of(t)
                         for inner, t in _tensors_in(vars(leaf), "", 0)})
    return held


def kept_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers and tensors kept as attributes (directly or in dicts, lists, tuples and plain
    objects) by ``module`` and its submodules, by attribute path; parameters are weights, not
    state, and are left out."""
    for prefix, owner in module.named_modules():
        dotted = f"{prefix}." if prefix else ""
        for name, buffer in owner.named_buffers(recurse=False):
            yield f"{dotted}{name}", buffer
        public = {k: v for k, v in vars(owner).items()
                  if not k.startswith("_") and not isinstance(v, nn.Module)}
        for path, tensor in _tensors_in(public, "", 0):
            if not isinstance(tensor, nn.Parameter):
                yield f"{dotted}{path}", tensor


def _tensors_in(value: Any, path: str, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif depth > _DEPTH or isinstance(value, (nn.Module, type)):
        return
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_in(item, f"{path}.{key}" if path else str(key), depth + 1)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors_in(item, f"{path}.{index}" if path else str(index), depth + 1)
    elif _is_object(value):
        yield from _tensors_in(vars(value), path, depth + 1)


def _is_object(value: Any) -> bool:
    """A plain object whose attributes may hold tensors (a cache), not a module or a class."""
    return hasattr(value, "__dict__") and not isinstance(value, (nn.Module, type)) and \
        not callable(value)


def state_difference(a: dict[str, Held], b: dict[str, Held]) -> tuple[str, str] | None:
    """The first state path both sides hold whose written extent differs, and how: ``holds 12
    positions in B, 11 in A; B never wrote position 10 (all zeros)``. A tensor laid out with
    another capacity but written alike is no difference."""
    for path in [p for p in a if p in b]:
        detail = _held_difference(a[path], b[path])
        if detail is not None:
            return path, detail
    return None


def _held_difference(a: Held, b: Held) -> str | None:
    if len(a.shape) != len(b.shape):
        return f"{len(b.shape)}-d in B, {len(a.shape)}-d in A"
    for dim in range(len(a.shape)):
        if a.extent[dim] == b.extent[dim] and a.holes.get(dim) == b.holes.get(dim):
            continue
        # Caches lay positions out in the last but one dimension (..., positions, features).
        positions = dim == len(a.shape) - 2
        slots, slot = ("positions", "position") if positions else (f"entries along dim {dim}",
                                                                   "entry")
        text = f"holds {b.extent[dim]} {slots} in B, {a.extent[dim]} in A"
        for side, held in (("B", b), ("A", a)):
            if held.holes.get(dim):
                which = ", ".join(map(str, held.holes[dim]))
                text += f"; {side} never wrote {slot} {which} (all zeros)"
        return text
    return None
