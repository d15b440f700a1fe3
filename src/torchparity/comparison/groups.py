"""Tensors judged together: one backward pass's gradients share its relative noise and a
residue's rounding, one module's its group's scale (``tolerance.KINDS``)."""

from __future__ import annotations

from torchparity import tolerance
from torchparity.comparison.sketch import relative_baseline_error
from torchparity.comparison.structure import Leaves
from torchparity.comparison.tensor import TensorComparison


def _group_of(path: str) -> str:
    """A leaf's group: a parameter's owning block (``layers.0.attn`` for
    ``layers.0.attn.q_proj.weight``), a top-level module itself, else its container."""
    container, _, key = path.rpartition("[")
    parts = key.removesuffix("]").strip('"').split(".")
    if len(parts) < 2:
        return container
    return f"{container}[{'.'.join(parts[:-2] or parts[:-1])}]"


def group_scales(
    leaves: Leaves, metric: tolerance.Metric
) -> dict[str, float]:
    """Each floating leaf's group scale: the largest golden magnitude among its members; a group
    that cancelled whole takes the comparison's (``tolerance.KINDS``, ``group_scale``)."""
    own = {path: tolerance.own_magnitude(g, metric)
           for path, _, g, _ in leaves if g.dtype.is_floating_point}
    group: dict[str, float] = {}
    for path, scale in own.items():
        group[_group_of(path)] = max(group.get(_group_of(path), 0.0), scale)
    overall = max(group.values(), default=0.0)
    group = {name: overall if tolerance.cancelled(scale, overall) else scale
             for name, scale in group.items()}
    return {path: group[_group_of(path)] or None for path in own}


def group_noises(
    leaves: Leaves, metric: tolerance.Metric, scales: dict[str, float],
    spreads: dict[str, float | None],
) -> dict[str, float]:
    """The relative noise the floating leaves with a baseline share: the largest err(baseline) or
    own rounding over their group scales; one backward pass rounds through one loss gradient,
    so one member's relative error is every member's."""
    relative = 0.0
    members = []
    for path, _, g, b in leaves:
        if b is None or not g.dtype.is_floating_point:
            continue
        # Relative to the group's scale: a member far smaller than its module carries the
        # module's rounding, which says nothing of the pass's.
        scale = max(tolerance.own_magnitude(g, metric), scales.get(path) or 0.0)
        members.append(path)
        relative = max(relative, relative_baseline_error(b, g, metric, scale),
                       (spreads.get(path) or 0.0) / scale if scale > 0 else 0.0)
    return dict.fromkeys(members, relative)


def residue_rounding(tensors: list[TensorComparison]) -> float:
    """The rounding that entered the backward pass at its residues (``tolerance.residue``): the
    largest error among those within budget. A residue's golden is nearly zero, so its error is
    the candidate's own rounding, carried in absolute terms to every gradient upstream (all
    members, as which are upstream is unknown)."""
    return max(
        (t.error for t in tensors
         if t.budget is not None and t.budget.residue and t.verdict != "diverged"),
        default=0.0,
    )


def likely_residues(leaves: Leaves, metric: tolerance.Metric,
                    scales: dict[str, float], share: float) -> set[str]:
    """The floating leaves whose golden's magnitude makes them residues of their group
    (``tolerance.residue``), unless masked entries change it."""
    return {path for path, _, g, _ in leaves if g.dtype.is_floating_point
            and tolerance.residue(tolerance.own_magnitude(g, metric), scales.get(path), share)}
