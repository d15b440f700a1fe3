"""Judgement of one call's tensors under the tolerance model, for every stage that compares."""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from typing import Any

import torch

from torchparity import sketching, tolerance
from torchparity.comparison import Comparison, StructureMismatch, compare
from torchparity.comparison.selection import LeftOut, PaddingSpec, left_out_of
from torchparity.comparison.sketch import involves_sketch
from torchparity.comparison.structure import Leaf, StructureDifference
from torchparity.diagnosis.core.results import (
    Bounded,
    Mismatch,
    NotCompared,
    Result,
    headroom,
    worst_error,
)
from torchparity.sketching import Sketch
from torchparity.subject.padding import Padding


def judge(candidate: dict[str, torch.Tensor], golden: dict[str, torch.Tensor],
          baseline: dict[str, torch.Tensor], kind: str, padding: PaddingSpec = None,
          precision: torch.dtype | None = None, noise: float | None = None,
          islands: str | None = None) -> Result:
    """Compare under the tolerance model (without a golden: against the baseline, with the
    analytic bound).

    Tensors on one side only are differences of structure, other shapes diverge, a baseline in
    another dtype than the candidate's is dropped, ``padding`` (:func:`module_padding`) is left
    out. A tensor whose golden is non-finite where A is finite is judged against A and says so
    (an eager attention turns float64's most negative mask value into -inf, and a fully masked
    row into NaN). ``precision`` sets the analytic bound (a float32 loss of bfloat16 outputs
    carries bfloat16's rounding); ``noise`` and ``islands`` as ``compare``'s."""
    candidate = as_a_names(candidate, golden or baseline)
    broken = _broken_goldens(golden, baseline, padding)
    island_dtype = _island_dtype(candidate, islands)
    if broken:
        result = _judged_against_a(candidate, golden, baseline, kind, padding, broken,
                                   precision or island_dtype, island_dtype)
    else:
        result = _judge(candidate, golden, baseline, kind, padding, island_dtype, noise=noise,
                        islands=island_dtype)
    return nothing_compared(result) or result


def _island_dtype(candidate: dict[str, torch.Tensor], islands: str | None
                  ) -> torch.dtype | None:
    """``islands`` as the dtype a float64 ``candidate`` is judged in; None for another dtype."""
    if islands is None:
        return None
    dtypes = {t.dtype for t in candidate.values()
              if isinstance(t, torch.Tensor) and t.is_floating_point()}
    return getattr(torch, islands) if dtypes == {torch.float64} else None


def as_a_names(candidate: dict[str, torch.Tensor], a_tensors: dict[str, torch.Tensor]
               ) -> dict[str, torch.Tensor]:
    """B's tensors under A's paths where only the container differs (``output.0`` vs ``output``)."""
    only_a = [p for p in a_tensors if p not in candidate]
    renamed = dict(candidate)
    for path in [p for p in candidate if p not in a_tensors]:
        partner = next((p for p in only_a if _in_a_tuple(p, path) or _in_a_tuple(path, p)), None)
        if partner is not None and tuple(a_tensors[partner].shape) == tuple(
                candidate[path].shape):
            renamed[partner] = renamed.pop(path)
            only_a.remove(partner)
    return renamed


def _in_a_tuple(inside: str, bare: str) -> bool:
    """Whether ``inside`` is ``bare`` as the first element of a tuple."""
    return inside == (f"{bare}.0" if bare else "0")


def _nothing_shared(result: Result) -> bool:
    return isinstance(result, Comparison) and not result.compared


def nothing_compared(result: Result) -> NotCompared | None:
    """A :class:`NotCompared` where both sides hold tensors but none alike; None otherwise."""
    structure = getattr(result, "structure", ())
    if not isinstance(result, Comparison) or result.tensors or not structure:
        return None
    a = sorted(d.path for d in structure if d.golden != "missing")
    b = sorted(d.path for d in structure if d.candidate != "missing")
    return NotCompared(result.kind, f"A and B share no tensor (A holds {_paths(a)}, B holds "
                                    f"{_paths(b)})", structure=structure)


def _paths(paths: list[str]) -> str:
    return ", ".join(paths) if paths else "none"


def _judge(candidate: dict[str, torch.Tensor], golden: dict[str, torch.Tensor],
           baseline: dict[str, torch.Tensor], kind: str, padding: PaddingSpec,
           compute_dtype: torch.dtype | None = None, noise: float | None = None,
           islands: torch.dtype | None = None) -> Result:
    original = baseline or golden
    if not golden:
        golden, baseline = baseline, {}
    same_dtypes = all(candidate[p].dtype == t.dtype for p, t in baseline.items()
                      if p in candidate)
    measured = baseline and same_dtypes
    try:
        result = compare(candidate, golden, baseline if measured else None, kind,
                         compute_dtype=compute_dtype, padding=padding,
                         noise=noise if measured else None, islands=islands)
    except StructureMismatch as exc:
        return Mismatch(kind, str(exc))
    result.structure = tuple(_as_a_sees_it(d, original)
                             for d in getattr(result, "structure", ()))
    result.shapes = tuple(dataclasses.replace(d, path=_flat_path(d.path))
                          for d in getattr(result, "shapes", ()))
    return result


def judge_departure(candidate: dict[str, torch.Tensor], golden: dict[str, torch.Tensor],
                    a_tensors: dict[str, torch.Tensor], padding: PaddingSpec = None,
                    islands: str | None = None) -> Result | None:
    """B's float64 tensors against A's float64 golden under float64 rounding (and ``islands``'),
    where the golden is finite wherever A is; None when nowhere."""
    broken = _broken_goldens(golden, a_tensors, padding)
    usable = {p: t for p, t in golden.items() if p not in broken}
    if not usable:
        return None
    return judge({p: t for p, t in candidate.items() if p not in broken}, usable, {}, "forward",
                 padding, islands=islands)


def _broken_goldens(golden: dict[str, torch.Tensor], baseline: dict[str, torch.Tensor],
                    padding: PaddingSpec) -> dict[str, int]:
    """Per path, how many judged golden elements are non-finite where A is finite."""
    broken = {}
    for path, g in golden.items():
        a = baseline.get(path)
        if a is None or involves_sketch(g, a) or a.shape != g.shape or \
                not g.is_floating_point() or tolerance.all_finite(g):
            continue
        left_out = left_out_of(padding, f'outputs["{path}"]', g)
        g, a = (t if left_out is None else left_out.judged(t) for t in (g, a.to(g.device)))
        n = int((~g.isfinite() & a.isfinite()).sum())
        if n:
            broken[path] = n
    return broken


def _judged_against_a(candidate: dict[str, torch.Tensor], golden: dict[str, torch.Tensor],
                      baseline: dict[str, torch.Tensor], kind: str, padding: PaddingSpec,
                      broken: dict[str, int], precision: torch.dtype | None,
                      islands: torch.dtype | None) -> Result:
    """The tensors of ``broken`` judged against A alone, the others as usual."""
    def part(tensors: dict[str, torch.Tensor], inside: bool) -> dict[str, torch.Tensor]:
        return {p: t for p, t in tensors.items() if (p in broken) == inside}

    against_a = _judge(part(candidate, True), {}, part(baseline, True), kind, padding,
                       precision, islands=islands)
    for t in getattr(against_a, "tensors", ()):
        n = broken.get(_flat_path(t.path))
        if n:
            t.notes.append(f"A's float64 golden is NaN or inf at {n} judged element(s) where A "
                           "is finite, so A is the reference here and the analytic bound the "
                           "budget")
    return merged(_judge(part(candidate, False), part(golden, False), part(baseline, False),
                         kind, padding, islands, islands=islands), against_a)


def _as_a_sees_it(difference: StructureDifference, a_tensors: dict[str, torch.Tensor]
                  ) -> StructureDifference:
    """A structure difference named by its flattened path, A's side described by A's own tensor."""
    path = _flat_path(difference.path)
    a_side = _describe(a_tensors[path]) if path in a_tensors else difference.golden
    return dataclasses.replace(difference, path=path, golden=a_side)


def with_leaves(result: Result, candidate_leaves: dict[str, Any]) -> Result:
    """``result``'s structure differences saying what the candidate holds instead (``None``, a
    cache)."""
    structure = getattr(result, "structure", ())
    if not structure:
        return result
    result.structure = tuple(
        dataclasses.replace(d, candidate=_describe(candidate_leaves[d.path]))
        if d.candidate == "missing" and d.path in candidate_leaves else d
        for d in structure)
    return result


def _describe(leaf: object) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"Tensor{tuple(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')}"
    if leaf is None or isinstance(leaf, (bool, int, float, str)):
        return repr(leaf)
    return type(leaf).__name__


def _flat_path(path: str) -> str:
    """``outputs["output.1"]`` -> ``output.1``."""
    found = re.fullmatch(r'outputs\["(.*)"\]', path)
    return found.group(1) if found else path


def module_padding(padding: Padding | None, module: str) -> PaddingSpec:
    """The padding of one module's tensors (encoder or decoder by its name); ``param.*`` gradients
    are judged whole."""
    if not padding:
        return None
    scoped = padding.within(module)
    return lambda path, tensor: None if _flat_path(path).startswith("param.") else \
        scoped(path, tensor)


def judge_quickly(candidate: dict[str, torch.Tensor], golden: dict[str, torch.Tensor],
                  baseline: dict[str, torch.Tensor], kind: str, padding: PaddingSpec = None,
                  precision: torch.dtype | None = None, noise: float | None = None,
                  islands: str | None = None) -> Result:
    """:func:`judge`, at a fraction of its cost when the answer is clearly "within".

    The budget is at least ``fudge`` times the baseline's error, so an error within that for
    every tensor is within budget: two norms decide it, the headroom reported as a bound. Any
    other case (no golden or baseline, structure or dtype differences, non-finite or masked
    values, a larger error) takes the full comparison; ``noise`` and ``islands`` only raise a
    budget."""
    quick = _bounded(candidate, golden, baseline, kind, padding)
    if quick is not None:
        return quick
    return judge(candidate, golden, baseline, kind, padding, precision, noise, islands)


def _bounded(candidate: dict[str, torch.Tensor], golden: dict[str, torch.Tensor],
             baseline: dict[str, torch.Tensor], kind: str, padding: PaddingSpec
             ) -> Bounded | None:
    if not golden or not candidate or not (candidate.keys() == golden.keys() == baseline.keys()):
        return None
    tol = tolerance.kind_tolerance(kind)
    errors, shares, identical = [], [], True
    for path, c in candidate.items():
        # each tensor by its own kind: a call may return a big output, kept as a sketch,
        # beside small ones kept whole
        sides = (c, golden[path], baseline[path])
        bound = _sketched_bound if involves_sketch(*sides) else _exact_bound
        one = bound(*sides, tol, kind,
                    functools.partial(left_out_of, padding, f'outputs["{path}"]'), identical)
        if one is None:
            return None
        error, share, identical = one
        errors.append(error)
        shares.append(share)
    verdict = "identical" if identical else "within"
    return Bounded(kind, verdict, max(errors), 0.0 if identical else max(shares))


#: One tensor's bound: its error, its share of the bound (0.0 where it equals the baseline,
#: as every tensor before it did) and whether that held; None where it takes the full one.
OneBound = tuple[float, float, bool] | None
#: The positions of a golden tensor that are not judged (None: none).
LeftOutOf = Callable[[Leaf], "LeftOut | None"]


def _exact_bound(c: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
                 tol: tolerance.KindTolerance, kind: str, left_out_of_golden: LeftOutOf,
                 identical: bool) -> OneBound:
    """Within ``fudge`` times the baseline's error, in the kind's metric."""
    if c.shape != g.shape or c.dtype != b.dtype or c.shape != b.shape or \
            not c.is_floating_point() or _masks(c, g, b):
        return None
    left_out = left_out_of_golden(g)
    if left_out is not None:
        c, g, b = (left_out.judged(t) for t in (c, g, b))
    if identical and torch.equal(c, b) and bool(torch.isfinite(c).all()):
        return tolerance.error(c, g, tol.metric), 0.0, True
    error, noise = tolerance.error(c, g, tol.metric), tolerance.error(b, g, tol.metric)
    # NaN and Inf make an error NaN or Inf, which fails this test: they get the full one.
    if not (0 < noise < math.inf and error <= tol.fudge * noise):
        return None
    return error, error / (tol.fudge * noise), False


def _sketched_bound(c: Leaf, g: Leaf, b: Leaf, tol: tolerance.KindTolerance, kind: str,
                    left_out_of_golden: LeftOutOf, identical: bool) -> OneBound:
    """Where a side is a sketch, ``compare_sketch``'s two rules against ``fudge`` times the
    baseline's error; a possibly degraded baseline, padding, non-finite or masked values take
    the full comparison."""
    if left_out_of_golden(g) is not None:
        return None
    reference = next(v for v in (g, c, b) if isinstance(v, Sketch))
    try:
        g, c, b = (sketching.like(reference, v) for v in (g, c, b))
    except ValueError:
        return None
    if c.shape != g.shape or c.shape != b.shape or c.dtype != b.dtype or g.rms <= 0 or \
            c.nonfinite or g.nonfinite or b.nonfinite or _masks(c.slices, g.slices, b.slices):
        return None
    error = sketching.error_estimate(c, g)
    if identical and c.same_values(b):
        return error, 0.0, True
    margin = tolerance.sketch_margin(g.size)
    noise = sketching.error_estimate(b, g)
    # The least bound the full comparison can set the baseline against (the group's scale
    # only raises it): within it, the baseline is not degraded.
    bound = tolerance.baseline_bound(g, compute_dtype=c.dtype, kind=kind,
                                     reduction_length=c.shape[-1] if c.shape else 1,
                                     metric="rms")
    slice_error = tolerance.error(c.slices, g.slices, tol.metric)
    slice_noise = tolerance.error(b.slices, g.slices, tol.metric)
    if not (0 < noise < math.inf and 0 < slice_noise < math.inf
            and tolerance.baseline_headroom(noise / margin, bound, error, kind) <= 1
            and error <= tol.fudge * noise * margin
            and slice_error <= tol.fudge * slice_noise):
        return None
    return error, max(error / (tol.fudge * noise * margin),
                      slice_error / (tol.fudge * slice_noise)), False


def _masks(*tensors: torch.Tensor) -> bool:
    """Whether any tensor holds masked entries, which only the full comparison sets apart."""
    return any(t.numel() and bool(t.amin() <= tolerance.MASKED_BELOW) for t in tensors)


def merged(first: Result | None, second: Result) -> Result:
    """One result for both: a mismatch wins, then a divergence; bounded ones keep the larger."""
    if first is None:
        return second
    for result in (first, second):
        if isinstance(result, Mismatch) or not (result.ok or _nothing_shared(result)):
            return result
    if isinstance(first, Bounded) or isinstance(second, Bounded):
        verdict = "identical" if first.verdict == second.verdict == "identical" else "within"
        return Bounded(first.kind, verdict, max(worst_error(first), worst_error(second)),
                       max(headroom(first), headroom(second)))
    return Comparison(kind=first.kind, tensors=first.tensors + second.tensors,
                      structure=(*first.structure, *second.structure),
                      shapes=(*first.shapes, *second.shapes))


def joined(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One call's tensors as they are; several calls' outputs concatenated on the last dimension
    (a fused module's)."""
    if len(parts) == 1:
        return parts[0]
    if any(len(p) != 1 or involves_sketch(*p.values()) for p in parts):
        return {}
    return {"output": torch.cat([next(iter(p.values())) for p in parts], dim=-1)}
