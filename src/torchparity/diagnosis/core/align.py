"""Alignment of two models' module calls: which call of B corresponds to which call of A.

Three passes, each over what the last left: names (A's, through ``name_map``); call order
and output shapes (between name-matched calls, the longest common subsequence of shapes);
fusion (one output the last-dimension concatenation of consecutive calls on the other side,
``qkv_proj`` for ``q_proj``, ``k_proj``, ``v_proj``). The rest is returned unmatched."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Literal

from torchparity.diagnosis.core.capture import ModuleCall, call_key
from torchparity.subject.names import (
    NameMap,
    common_subsequence,
    concatenations,
    name_translator,
)

__all__ = ["Alignment", "Match", "NameMap", "align", "name_translator"]

How = Literal["name", "name_map", "order", "fused"]


@dataclass(frozen=True)
class Match:
    """Calls of A and B that compute the same thing; one side has one call (``fused``: the
    other's outputs concatenated along the last dimension)."""

    a: tuple[ModuleCall, ...]
    b: tuple[ModuleCall, ...]
    how: How

    @property
    def a_name(self) -> str:
        return "+".join(c.key for c in self.a)

    @property
    def b_name(self) -> str:
        return "+".join(c.key for c in self.b)

    @property
    def order(self) -> int:
        """When the match is complete in B's run: the last of its B calls to finish."""
        return max(c.order for c in self.b)

    @property
    def one_to_one(self) -> bool:
        """Whether one call of A matches one call of B (not a fused group)."""
        return len(self.a) == 1 and len(self.b) == 1


@dataclass
class Alignment:
    """Matches in the order B's calls finished, and the calls of each side left unmatched."""

    matches: list[Match]
    unmatched_a: list[ModuleCall] = field(default_factory=list)
    unmatched_b: list[ModuleCall] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        counts = {how: 0 for how in ("name", "name_map", "order", "fused")}
        for match in self.matches:
            counts[match.how] += 1
        return counts


def align(
    calls_a: Sequence[ModuleCall],
    calls_b: Sequence[ModuleCall],
    name_map: NameMap | None = None,
    *,
    by_order: bool = True,
) -> Alignment:
    """Align A's calls with B's (both in finish order): every call in one match or one unmatched
    list; by name only with the same call index; ``by_order=False`` leaves the rest unmatched."""
    calls_a = sorted(calls_a, key=lambda c: c.order)
    calls_b = sorted(calls_b, key=lambda c: c.order)
    matches = _match_names(calls_a, calls_b, name_translator(name_map))
    if by_order:
        matches += _match_gaps(calls_a, calls_b, matches)
    used_a = {id(c) for m in matches for c in m.a}
    used_b = {id(c) for m in matches for c in m.b}
    return Alignment(
        matches=sorted(matches, key=lambda m: m.order),
        unmatched_a=[c for c in calls_a if id(c) not in used_a],
        unmatched_b=[c for c in calls_b if id(c) not in used_b],
    )


def _match_names(calls_a: Sequence[ModuleCall], calls_b: Sequence[ModuleCall],
                 translate: Callable[[str], str]) -> list[Match]:
    b_by_key = {c.key: c for c in calls_b}
    matches = []
    for a in calls_a:
        b_name = translate(a.name)
        b = b_by_key.pop(call_key(b_name, a.call), None)
        if b is not None:
            matches.append(Match((a,), (b,), "name" if b_name == a.name else "name_map"))
    return matches


def _match_gaps(calls_a: Sequence[ModuleCall], calls_b: Sequence[ModuleCall],
                anchors: list[Match]) -> list[Match]:
    """Align the unmatched calls between consecutive anchors (name matches in both orders)."""
    matched_a = {id(c) for m in anchors for c in m.a}
    matched_b = {id(c) for m in anchors for c in m.b}
    bounds = [(-1, -1), *_monotone([(m.a[0].order, m.b[0].order) for m in anchors]),
              (len(calls_a), len(calls_b))]
    found = []
    for (a_lo, b_lo), (a_hi, b_hi) in pairwise(bounds):
        gap_a = [c for c in calls_a[a_lo + 1:a_hi] if id(c) not in matched_a]
        gap_b = [c for c in calls_b[b_lo + 1:b_hi] if id(c) not in matched_b]
        if gap_a and gap_b:
            found += _align_gap(gap_a, gap_b)
    return found


def _monotone(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The anchors, in A's order, whose B positions also increase (crossing ones are skipped)."""
    chain: list[tuple[int, int]] = []
    for a_pos, b_pos in sorted(pairs):
        if not chain or b_pos > chain[-1][1]:
            chain.append((a_pos, b_pos))
    return chain


def _align_gap(gap_a: list[ModuleCall], gap_b: list[ModuleCall]) -> list[Match]:
    pairs = common_subsequence([_shapes(c) for c in gap_a], [_shapes(c) for c in gap_b])
    matches = [Match((gap_a[i],), (gap_b[j],), "order") for i, j in pairs]
    paired_a, paired_b = {i for i, _ in pairs}, {j for _, j in pairs}
    rest_a = [c for i, c in enumerate(gap_a) if i not in paired_a]
    rest_b = [c for j, c in enumerate(gap_b) if j not in paired_b]
    matches += [Match(parts, (whole,), "fused")
                for whole, parts in concatenations(rest_b, rest_a, _single_shape, -1)]
    fused_a = {id(c) for m in matches for c in m.a}
    rest_a = [c for c in rest_a if id(c) not in fused_a]
    matches += [Match((whole,), parts, "fused")
                for whole, parts in concatenations(rest_a, rest_b, _single_shape, -1)]
    return matches


def _shapes(call: ModuleCall) -> tuple[tuple[int, ...], ...]:
    return tuple(call.output_shapes.values())


def _single_shape(call: ModuleCall) -> tuple[int, ...] | None:
    shapes = _shapes(call)
    return shapes[0] if len(shapes) == 1 and shapes[0] else None
