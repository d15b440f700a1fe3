"""Two versions of a model matched by meaning where their names differ: name maps, and alignment.

A renamed module keeps its place and shapes: sequences pair as the longest common subsequence of
their shapes. Fused modules (``qkv`` for ``q``, ``k``, ``v``) put one tensor where there were
several, consecutive and concatenated along one dimension.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from torchparity.errors import UsageError

__all__ = ["NameMap", "common_subsequence", "concatenations", "name_translator"]

#: A's module names to B's: exact names in a dict, or ``(regex, replacement)`` pairs where the
#: first regex that matches the whole of A's name gives B's name (``\1`` groups allowed).
NameMap = Mapping[str, str] | Sequence[tuple[str, str]]

#: How to hand a name map on the command line (``diagnose`` and ``check``).
NAME_MAP_OPTION = "--name-map REGEX=REPLACEMENT (a regex on the whole name; repeatable)"

Item = TypeVar("Item")
Shape = tuple[int, ...]


def name_translator(name_map: NameMap | None) -> Callable[[str], str]:
    """A function from A's module names to B's per ``name_map`` (None: unchanged); unmatched stay.

    Raises:
        UsageError: an entry is not a pair, or its regex does not compile.
    """
    if name_map is None:
        return lambda name: name
    if isinstance(name_map, Mapping):
        return lambda name: name_map.get(name, name)
    rules = []
    for pair in name_map:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise UsageError(
                f"name_map entry {pair!r} is not a (regex, replacement) pair; pass a dict of "
                "A-name -> B-name or a list of (regex, replacement) pairs")
        try:
            rules.append((re.compile(pair[0]), pair[1]))
        except re.error as exc:
            raise UsageError(f"name_map regex {pair[0]!r} is invalid: {exc}") from None

    def translate(name: str) -> str:
        for regex, replacement in rules:
            found = regex.fullmatch(name)
            if found:
                return found.expand(replacement)
        return name

    return translate


def common_subsequence(xs: Sequence[object], ys: Sequence[object]) -> list[tuple[int, int]]:
    """Increasing index pairs ``(i, j)`` of a longest common subsequence of non-empty items."""
    # most modules run in the same order: this pairing survives one added or removed
    n, m = len(xs), len(ys)
    best = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            if xs[i] and xs[i] == ys[j]:
                best[i][j] = best[i + 1][j + 1] + 1
            else:
                best[i][j] = max(best[i + 1][j], best[i][j + 1])
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        if xs[i] and xs[i] == ys[j]:
            pairs.append((i, j))
            i, j = i + 1, j + 1
        elif best[i + 1][j] >= best[i][j + 1]:
            i += 1
        else:
            j += 1
    return pairs


def concatenations(wholes: Sequence[Item], parts: Sequence[Item],
                   shape_of: Callable[[Item], Shape | None], dim: int
                   ) -> list[tuple[Item, tuple[Item, ...]]]:
    """``(whole, parts)``: each whole shaped as 2+ consecutive ``parts`` joined along ``dim``."""
    # a fused weight (qkv) as the parts another version keeps apart; each part used once; an empty
    # shape takes no part
    found, used = [], set()
    for whole in wholes:
        target = shape_of(whole)
        if not target:
            continue
        for start in range(len(parts)):
            run = _concatenating_run(parts[start:], target, shape_of, dim, used)
            if run:
                found.append((whole, run))
                used.update(id(part) for part in run)
                break
    return found


def _concatenating_run(parts: Sequence[Item], target: Shape,
                       shape_of: Callable[[Item], Shape | None], dim: int, used: set[int]
                       ) -> tuple[Item, ...] | None:
    dim = dim % len(target)
    run, width = [], 0
    for part in parts:
        shape = shape_of(part)
        if (id(part) in used or not shape or len(shape) != len(target)
                or shape[:dim] + shape[dim + 1:] != target[:dim] + target[dim + 1:]):
            return None
        run.append(part)
        width += shape[dim]
        if width == target[dim]:
            return tuple(run) if len(run) > 1 else None
        if width > target[dim]:
            return None
    return None
