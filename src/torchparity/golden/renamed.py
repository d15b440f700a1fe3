"""The goldens' tensors found in a model whose names changed since they were made.

Goldens record their state dict's layout (:func:`state_layout`). A model whose layout differs is
paired with it as diagnose pairs module calls, each pass over what the previous left: by (mapped)
**names**; by **order and shape** (the longest common subsequence by kind and shape); as a
**fusion** (``qkv.weight`` from consecutive ``q``, ``k``, ``v`` rows); and as a **split** (the
other way round). A :class:`Renaming` gives the model's state under the goldens' names and judges
gradients part by part, so a failing part is named; a fused golden kept as a sketch cannot be
cut, so the model's parts are joined into it and judged whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchparity.sketching import Sketch
from torchparity.subject.names import (
    NAME_MAP_OPTION,
    NameMap,
    common_subsequence,
    concatenations,
    name_translator,
)

#: Name -> shape, or for a tied tensor the name of the one it ties to, in the model's order.
Layout = dict[str, Any]


def state_layout(model: nn.Module) -> Layout:
    """Name -> shape (or the name a tied tensor ties to) of ``model``'s state dict, in its order."""
    first: dict[int, str] = {}
    layout: Layout = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        tied = first.setdefault(id(tensor), name)
        layout[name] = list(tensor.shape) if tied == name else tied
    return layout


@dataclass(frozen=True)
class Piece:
    """A tensor ``name`` as rows ``start`` to ``start + rows`` of a fused one (either side's)."""

    name: str
    start: int
    rows: int


@dataclass
class Renaming:
    """How the goldens' tensors are found in the model, and what neither side found."""

    # per model tensor named otherwise: one piece renamed, several fused
    pieces: dict[str, tuple[Piece, ...]] = field(default_factory=dict)
    # the model's parts of each golden it keeps apart
    splits: dict[str, tuple[Piece, ...]] = field(default_factory=dict)
    joined: frozenset[str] = frozenset()  # splits whose golden gradient is a sketch: judged whole
    ties: dict[str, str] = field(default_factory=dict)
    unmatched_golden: list[str] = field(default_factory=list)
    unmatched_model: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Whether every tensor of both sides found its counterpart."""
        return not (self.unmatched_golden or self.unmatched_model)

    def split(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """``(golden name, tensor or its rows)``: the model's ``name`` as the goldens name it."""
        pieces = self.pieces.get(name)
        if pieces is None or len(pieces) == 1:  # the same tensor, renamed, or a part
            yield (name if pieces is None else pieces[0].name), tensor
            return
        for piece in pieces:
            yield piece.name, tensor.narrow(0, piece.start, piece.rows)

    def gradient_keeper(self, keep: Callable[[str, torch.Tensor], None]
                        ) -> Callable[[str, torch.Tensor], None]:
        """What takes the model's gradients in any order, calling ``keep`` by judged names."""
        whole_of = {piece.name: whole for whole in self.joined for piece in self.splits[whole]}
        # a fused gradient kept as the goldens' parts; a joined golden's parts kept joined once the
        # last arrives
        waiting: dict[str, dict[str, torch.Tensor]] = {}

        def take(name: str, tensor: torch.Tensor) -> None:
            whole = whole_of.get(name)
            if whole is None:
                for judged, part in self.split(name, tensor):
                    keep(judged, part)
                return
            parts = waiting.setdefault(whole, {})
            parts[name] = tensor.detach().clone()  # the run may reuse its gradient's memory
            if len(parts) == len(self.splits[whole]):
                del waiting[whole]
                keep(whole, torch.cat([parts[p.name] for p in self.splits[whole]]))

        return take

    def judged_goldens(self, tensors: Mapping[str, torch.Tensor | Sketch]
                       ) -> dict[str, torch.Tensor | Sketch]:
        """The goldens' gradients by judged name: one the model splits (unless joined) as parts."""
        judged = dict(tensors)
        for whole, pieces in self.splits.items():
            if whole in judged and whole not in self.joined:
                tensor = judged.pop(whole)
                judged |= {p.name: tensor.narrow(0, p.start, p.rows) for p in pieces}
        return judged

    def golden_state(self, state: Mapping[str, torch.Tensor], model: Layout
                     ) -> dict[str, torch.Tensor]:
        """The model's ``state`` under the goldens' names, tied names as the goldens have them."""
        found = {golden: part for name, tensor in state.items()
                 if not isinstance(model[name], str) for golden, part in self.split(name, tensor)}
        for whole, pieces in self.splits.items():
            found[whole] = torch.cat([found.pop(p.name) for p in pieces])
        return found | {alias: found[first] for alias, first in self.ties.items()
                        if first in found}

    def model_tensor(self, name: str, golden: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The model's tensor ``name`` made of the goldens' state: :meth:`golden_state` undone."""
        pieces = self.pieces.get(name)
        if pieces:
            parts = [golden[p.name] for p in pieces]
            return torch.cat(parts) if len(parts) > 1 else parts[0]
        for whole, parts in self.splits.items():
            for piece in parts:
                if piece.name == name:
                    return golden[whole].narrow(0, piece.start, piece.rows)
        return golden[name]

    def summary(self) -> str:
        """The modules named otherwise: ``attn.qkv <- attn.q+attn.k+attn.v [fused]``, ..."""
        said: dict[str, None] = {}
        for name, pieces in self.pieces.items():
            golden = "+".join(_module(p.name) or "(model)" for p in pieces)
            how = "fused" if len(pieces) > 1 else "renamed"
            said[f"{_module(name) or '(model)'} <- {golden} [{how}]"] = None
        for whole, pieces in self.splits.items():
            parts = "+".join(_module(p.name) or "(model)" for p in pieces)
            said[f"{parts} <- {_module(whole) or '(model)'} [split]"] = None
        return ", ".join(said)

    def unmatched_sentence(self, entry: str) -> str:
        """Which names found no counterpart, and how to hand a map, naming ``entry``."""
        golden = ", ".join(self.unmatched_golden) or "nothing"
        model = ", ".join(self.unmatched_model) or "nothing"
        return (f"the weights' names or shapes changed: the goldens' {golden} and the model's "
                f"{model} ({entry}) pair with nothing by name, order and shape; map the "
                f"goldens' module names to the model's with {NAME_MAP_OPTION} (name_map= in "
                "tp.check_model)")


def renaming(golden: Layout, model: Layout, name_map: NameMap | None = None,
             sketched: frozenset[str] = frozenset()) -> Renaming:
    """Pair the goldens' tensors with the model's: by name, order and shape, or as parts.

    Args:
        golden: the layout the goldens record.
        model: the model's layout now.
        name_map: the goldens' module names to the model's, tried first.
        sketched: the goldens' names whose gradient the goldens keep as a sketch.

    Raises:
        UsageError: a ``name_map`` entry that is not a pair, or whose regex does not compile.
    """
    renamed = Renaming(ties={name: first for name, first in golden.items()
                             if isinstance(first, str)})
    rest_a = [name for name, shape in golden.items() if not isinstance(shape, str)]
    rest_b = [name for name, shape in model.items() if not isinstance(shape, str)]
    shape_of = {**{("a", n): tuple(golden[n]) for n in rest_a},
                **{("b", n): tuple(model[n]) for n in rest_b}}
    pairs: list[tuple[str, tuple[str, ...]]] = []
    splits: list[tuple[str, tuple[str, ...]]] = []

    def take(whole: str, parts: tuple[str, ...]) -> None:
        pairs.append((whole, parts))
        rest_b.remove(whole)
        for part in parts:
            rest_a.remove(part)

    def take_split(whole: str, parts: tuple[str, ...]) -> None:
        splits.append((whole, parts))
        rest_a.remove(whole)
        for part in parts:
            rest_b.remove(part)

    translate = name_translator(name_map)
    by_name: dict[str, list[str]] = {}
    for name in rest_a:
        module, dot, kind = name.rpartition(".")
        by_name.setdefault(f"{translate(module)}{dot}{kind}" if dot else name, []).append(name)
    for whole in list(rest_b):
        parts = tuple(by_name.get(whole, ()))
        if parts and _stacks(shape_of[("b", whole)], [shape_of[("a", p)] for p in parts]):
            take(whole, parts)
    keys_a = [(_kind(n), shape_of[("a", n)]) for n in rest_a]
    keys_b = [(_kind(n), shape_of[("b", n)]) for n in rest_b]
    for a, b in [(rest_a[i], rest_b[j]) for i, j in common_subsequence(keys_a, keys_b)]:
        take(b, (a,))
    for kind in dict.fromkeys(_kind(n) for n in rest_b):
        wholes = [("b", n) for n in rest_b if _kind(n) == kind]
        parts = [("a", n) for n in rest_a if _kind(n) == kind]
        for (_, whole), found in concatenations(wholes, parts, shape_of.get, 0):
            take(whole, tuple(name for _, name in found))
    for kind in dict.fromkeys(_kind(n) for n in rest_a):
        wholes = [("a", n) for n in rest_a if _kind(n) == kind]
        parts = [("b", n) for n in rest_b if _kind(n) == kind]
        for (_, whole), found in concatenations(wholes, parts, shape_of.get, 0):
            take_split(whole, tuple(name for _, name in found))
    starts = _pieces(pairs, lambda part: shape_of[("a", part)])
    renamed.pieces = {whole: starts[whole] for whole in model if whole in starts
                      and [p.name for p in starts[whole]] != [whole]}
    renamed.splits = _pieces(splits, lambda part: shape_of[("b", part)])
    renamed.joined = frozenset(renamed.splits) & sketched
    renamed.unmatched_golden = [f"{n} {_shape(shape_of[('a', n)])}" for n in rest_a]
    renamed.unmatched_model = [f"{n} {_shape(shape_of[('b', n)])}" for n in rest_b]
    return renamed


def _pieces(wholes: list[tuple[str, tuple[str, ...]]],
            shape_of: Callable[[str], tuple[int, ...]]) -> dict[str, tuple[Piece, ...]]:
    """Each whole's parts as the stretches of its rows they are, in order."""
    found = {}
    for whole, parts in wholes:
        row, pieces = 0, []
        for part in parts:
            rows = shape_of(part)[0] if shape_of(part) else 1
            pieces.append(Piece(part, row, rows))
            row += rows
        found[whole] = tuple(pieces)
    return found


def _shape(shape: tuple[int, ...]) -> str:
    return f"({', '.join(map(str, shape))})"


def _stacks(whole: tuple[int, ...], parts: list[tuple[int, ...]]) -> bool:
    """Whether ``parts`` concatenated along dimension 0 have the shape ``whole``."""
    if len(parts) == 1:
        return parts[0] == whole
    return bool(whole) and all(len(p) == len(whole) and p[1:] == whole[1:] for p in parts) \
        and sum(p[0] for p in parts) == whole[0]


def _kind(name: str) -> str:
    return name.rpartition(".")[2]


def _module(name: str) -> str:
    return name.rpartition(".")[0]
