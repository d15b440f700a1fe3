"""Alignment of two op streams from different code, as sequences.

Two revisions run different ops: inserted, removed, reordered or fused (``addmm`` for three
ops, ``cat`` for a write into a buffer). The streams are aligned as the best monotone pairing,
then a pass for moved ops, scored on the op, shapes and dtypes, dataflow, values (B runs on
A's inputs) and weakly the source text. Every step ends paired or one-sided; a paired op's
differing non-tensor arguments are named."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from torchparity import sketching
from torchparity.diagnosis.stages.ops.capture import Step
from torchparity.sketching import Sketch

__all__ = ["Pair", "align_steps"]

#: Above this many cells the sequence alignment pairs identical signatures only (difflib).
_LARGEST_TABLE = 250_000


@dataclass
class Pair:
    """One line of an aligned stream: a step of A and its partner in B, or a step of one side."""

    a: Step | None
    b: Step | None
    moved: bool = False  # paired out of sequence: the op was reordered
    differences: list[str] = field(default_factory=list)  # non-tensor arguments that differ

    @property
    def kind(self) -> str:
        """``"paired"``, ``"only in A"`` or ``"only in B"``."""
        if self.a is not None and self.b is not None:
            return "paired"
        return "only in A" if self.b is None else "only in B"

    @property
    def name(self) -> str:
        step = self.b if self.b is not None else self.a
        return step.name


def align_steps(a: list[Step], b: list[Step]) -> list[Pair]:
    """``a`` and ``b`` aligned, in B's order (steps only in A where their neighbours put them).
    Never raises on streams of different lengths or kinds."""
    first = _sequence(a, b, {})
    partners = {p.a.index: p.b.index for p in first if p.a is not None and p.b is not None}
    pairs = _sequence(a, b, partners)  # again, now crediting inputs made by paired steps
    pairs = _moved(pairs)
    for pair in pairs:
        if pair.a is not None and pair.b is not None:
            pair.differences = argument_differences(pair.a, pair.b)
    return pairs


def argument_differences(a: Step, b: Step) -> list[str]:
    """``eps 1e-05 (A) vs 0.001 (B)`` for each non-tensor argument of a paired op that differs
    (``default`` where a side left it to the op)."""
    if a.kind != "op":
        return []
    found = []
    for name in dict.fromkeys([*a.scalars, *b.scalars]):
        left, right = (_text(s.scalars[name]) if name in s.scalars else "default"
                       for s in (a, b))
        if left != right:
            left, right = _shown(left, right)
            found.append(f"{name} {left} (A) vs {right} (B)")
    if a.op != b.op:
        found.insert(0, f"op {a.name} (A) vs {b.name} (B)")
    return found


def _text(value: object) -> str:
    return repr(value)


def _shown(left: str, right: str) -> tuple[str, str]:
    """Two differing arguments as a report writes them: a float that is exactly a float32 (an
    ``eps``) by its shortest float32 text, unless the two would then read alike."""
    short = _shortest_float32(left), _shortest_float32(right)
    return (left, right) if short[0] == short[1] else short


def _shortest_float32(text: str) -> str:
    try:
        value = float(text)
    except ValueError:
        return text
    single = torch.tensor(value, dtype=torch.float32)
    if value != float(single):
        return text
    for digits in range(1, 10):  # 9 significant digits tell any two float32 apart
        short = repr(float(f"{value:.{digits}g}"))
        if torch.tensor(float(short), dtype=torch.float32) == single:
            return short if len(short) < len(text) else text
    return text


def _sequence(a: list[Step], b: list[Step], partners: dict[int, int]) -> list[Pair]:
    """The best-scoring monotone pairing (Needleman-Wunsch, free gaps)."""
    n, m = len(a), len(b)
    if n * m > _LARGEST_TABLE:
        return _by_signature(a, b)
    score = [[0.0] * (m + 1) for _ in range(n + 1)]
    gain: dict[tuple[int, int], float] = {}
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            best = max(score[i - 1][j], score[i][j - 1])
            s = _similarity(a[i - 1], b[j - 1], partners)
            if s is not None:
                gain[i, j] = s
                best = max(best, score[i - 1][j - 1] + s)
            score[i][j] = best
    pairs: list[Pair] = []
    i, j = n, m
    while i > 0 or j > 0:
        if i > 0 and j > 0 and (i, j) in gain and score[i][j] == score[i - 1][j - 1] + gain[i, j]:
            pairs.append(Pair(a[i - 1], b[j - 1]))
            i, j = i - 1, j - 1
        elif j > 0 and (i == 0 or score[i][j] == score[i][j - 1]):
            pairs.append(Pair(None, b[j - 1]))
            j -= 1
        else:
            pairs.append(Pair(a[i - 1], None))
            i -= 1
    return pairs[::-1]


def _by_signature(a: list[Step], b: list[Step]) -> list[Pair]:
    import difflib

    matcher = difflib.SequenceMatcher(None, [s.signature for s in a],
                                      [s.signature for s in b], autojunk=False)
    pairs, i, j = [], 0, 0
    for block in matcher.get_matching_blocks():
        pairs += [Pair(step, None) for step in a[i:block.a]]
        pairs += [Pair(None, step) for step in b[j:block.b]]
        pairs += [Pair(a[block.a + k], b[block.b + k]) for k in range(block.size)]
        i, j = block.a + block.size, block.b + block.size
    return pairs


#: Ops that only lay the same values out anew: the layout is all they compute, so two of
#: them are one computation only on outputs of as many dimensions (the reshapes around
#: eager's matmuls and around sdpa's kernel are not; a view of 12 keys where A's has 11, the
#: same layout of a longer cache, is).
LAYOUT = frozenset({"aten::view", "aten::_unsafe_view", "aten::reshape", "aten::expand",
                     "aten::transpose", "aten::permute", "aten::unsqueeze", "aten::squeeze",
                     "aten::t"})


def _similarity(x: Step, y: Step, partners: dict[int, int]) -> float | None:
    """How much pairing ``x`` with ``y`` is worth; None when they cannot be one computation."""
    if x.kind != y.kind:
        return None
    sx, sy = x.signature, y.signature
    same_outputs = sx[3] == sy[3]
    if (x.op in LAYOUT or y.op in LAYOUT) and [len(s) for s, _ in sx[3]] != \
            [len(s) for s, _ in sy[3]]:
        return None
    if x.op != y.op and not (x.kind == "op" and same_outputs and _close(x, y)):
        return None  # another op pairs only as a stand-in of the same result (a fused form)
    score = 3.0 if x.op == y.op else 1.0
    score += 2.0 * same_outputs + 1.0 * (sx[2] == sy[2])
    flows = [(p, q) for p, q in zip(x.producers, y.producers, strict=False)
             if p is not None and q is not None]
    score += sum(2.0 for p, q in flows if partners.get(p) == q)
    if same_outputs and _close(x, y):
        score += 1.0
    if x.code and x.code == y.code:
        score += 0.5
    return score


#: Two outputs whose difference is under this share of their norm count as one computation's
#: when pairing a fused op with the ops it replaces. It is evidence for the alignment only,
#: far above any rounding and far below a real change of the value; the verdict on the pair
#: is the tolerance model's.
SAME_VALUES_SHARE = 1e-3


def _close(x: Step, y: Step) -> bool:
    """Whether the outputs are nearly the same values: evidence of one computation, not a
    verdict (that is the tolerance model's)."""
    for left, right in zip(x.outputs.values(), y.outputs.values(), strict=False):
        if isinstance(right, Sketch):
            left, right = right, left
        if isinstance(left, Sketch):  # a big output, kept as its sketch
            right = sketching.like(left, right)
            if sketching.error_estimate(left, right) > SAME_VALUES_SHARE * (left.rms + right.rms):
                return False
            continue
        if not (left.is_floating_point() and right.is_floating_point()):
            if not torch.equal(left, right):
                return False
            continue
        # float32 is ample for a share of 1e-3, and a pass cheaper than float64's copies
        left, right = left.float(), right.float()
        scale = left.norm() + right.norm()
        if scale > 0 and (left - right).norm() > SAME_VALUES_SHARE * scale:
            return False
    return True


def _moved(pairs: list[Pair]) -> list[Pair]:
    """Steps left on one side each that are the same op on the same shapes: a reordered op,
    paired at B's place (the closest in values first, then in order)."""
    only_a = [p for p in pairs if p.b is None]
    for pair in pairs:
        if pair.a is not None or pair.b is None:
            continue
        alike = [p for p in only_a if p.a.signature == pair.b.signature]
        partner = next((p for p in alike if _close(p.a, pair.b)), alike[0] if alike else None)
        if partner is not None:
            only_a.remove(partner)
            pair.a, pair.moved = partner.a, True
    kept = {id(p) for p in only_a}
    return [p for p in pairs if p.b is not None or id(p) in kept]
