"""Judging a tensor known only by its sketch (:mod:`torchparity.sketching`).

Where any side is a :class:`~torchparity.sketching.Sketch`, the others are sketched with the
same buckets and two things are judged: the RMS error estimated from the projections,
``est(candidate) <= fudge * noise + floor`` (noise: the baseline's estimate at its upper
confidence bound times :func:`~torchparity.tolerance.sketch_margin`, at least the floor and
for gradients the group's; scale: the golden's exact RMS), so a change must be ``margin``
times larger than the full rule needs to be certain to show; and the exact slices (the
first elements of the first and last rows) under the kind's ordinary rule. A max-abs kind
cannot be judged whole: a change confined outside the slices moves the RMS by sqrt(share of
elements) of its size (docs/tolerance.md measures what still shows)."""

from __future__ import annotations

import dataclasses
import math

import torch

from torchparity import sketching, tolerance
from torchparity.comparison.settings import Settings
from torchparity.comparison.structure import StructureMismatch, torch_dtype_name
from torchparity.comparison.tensor import (
    TensorComparison,
    as_float64,
    compare_tensor,
    degraded_note,
)
from torchparity.sketching import Sketch
from torchparity.tolerance import Metric


def involves_sketch(*values: object) -> bool:
    """Whether any of ``values`` is a sketch (the tensor is then judged by
    :func:`compare_sketch`)."""
    return any(isinstance(v, Sketch) for v in values)


def compare_sketch(
    path: str,
    candidate: torch.Tensor | Sketch,
    golden: torch.Tensor | Sketch,
    baseline: torch.Tensor | Sketch | None,
    settings: Settings,
    input_noise: float | None = None,
) -> TensorComparison:
    """One tensor's comparison when any of the three is sketched: the RMS estimate as its
    error, the slices' errors and worst element; settings as for
    :func:`~torchparity.comparison.tensor.compare_tensor`. :class:`StructureMismatch` when two
    sketches have other buckets."""
    reference = next(v for v in (golden, candidate, baseline) if isinstance(v, Sketch))
    try:
        g, c = sketching.like(reference, golden), sketching.like(reference, candidate)
        b = None if baseline is None else sketching.like(reference, baseline)
    except ValueError as exc:
        raise StructureMismatch(f"{path}: {exc}") from None
    if not c.dtype.is_floating_point:
        raise StructureMismatch(f"{path}: a sketch holds a floating tensor, the candidate is "
                                f"{torch_dtype_name(c.dtype)}")
    kind = settings.kind
    precision = tolerance.precision(settings.compute_dtype if settings.compute_dtype is not None
                                    else c.dtype)
    length = settings.reduction_length if settings.reduction_length is not None else (
        c.shape[-1] if c.shape else 1)
    margin = tolerance.sketch_margin(g.size)
    error = sketching.error_estimate(c, g)
    baseline_error = None if b is None else sketching.error_estimate(b, g)
    baseline_headroom = None
    notes = [f"sketched: RMS error estimated from {g.size} coordinates"
             f" (±{tolerance.sketch_spread(g.size):.1%}); max-abs error and worst element"
             f" over the {g.slices.numel()} exact elements of its first and last rows"]
    bound_dtype = tolerance.coarser(precision.name, settings.islands)
    if baseline_error is not None:
        bound = tolerance.baseline_bound(g, compute_dtype=bound_dtype, kind=kind,
                                         reduction_length=length,
                                         group_scale=settings.group_scale, metric="rms")
        baseline_headroom = tolerance.baseline_headroom(baseline_error / margin, bound, error,
                                                        kind)
        if baseline_headroom > 1:
            notes.append(degraded_note(baseline_error, bound, bound_dtype, kind,
                                       "about (RMS) "))
            b = baseline_error = None  # a degraded baseline sets no budget
    spent = tolerance.budget(tolerance.Measurement(
        g, baseline_error=None if baseline_error is None else baseline_error * margin,
        compute_dtype=precision.name, kind=kind, reduction_length=length, step=settings.step,
        group_scale=settings.group_scale, group_noise=settings.group_noise,
        inherited=settings.inherited, atol=settings.atol, rtol=settings.rtol, metric="rms",
        islands=settings.islands, input_noise=input_noise if b is not None else None))
    if spent.noise_source == "baseline error":
        spent = dataclasses.replace(
            spent, noise_source=f"baseline error (sketched, × {margin:.3g} for its spread)")
    slices = compare_tensor(
        path, c.slices, g.slices, None if b is None else b.slices,
        dataclasses.replace(settings, compute_dtype=precision.name, reduction_length=length,
                            inherited=0.0), input_noise=input_noise if b is not None else None)
    notes += [f"slices: {note}" for note in slices.notes]
    faults = c.nonfinite != g.nonfinite
    if faults:
        notes.insert(0, f"candidate has {c.nonfinite} NaN/inf, the golden {g.nonfinite}")
    headroom = math.inf if faults else max(error / spent.value, slices.headroom)
    if faults:
        verdict = "diverged"
    elif c.same_values(g) or (b is not None and c.same_values(b)):
        verdict = "identical"
    else:
        within = error <= spent.value and slices.verdict != "diverged"
        verdict = "within" if within else "diverged"
    worst = None if slices.worst_index is None else g.slice_index(slices.worst_index[0])
    return TensorComparison(
        path=path,
        shape=tuple(c.shape),
        dtype=torch_dtype_name(c.dtype),
        compute_dtype=precision.name,
        kind=kind,
        verdict=verdict,
        max_abs=slices.max_abs,
        max_rel=slices.max_rel,
        rms=error,
        rel_l2=error / max(g.rms, 1e-300),
        cosine=sketching.cosine_estimate(c, g),
        max_ulp=slices.max_ulp,
        n_over=slices.n_over,
        frac_over=slices.frac_over,
        worst_index=worst,
        candidate_value=slices.candidate_value,
        baseline_value=slices.baseline_value,
        golden_value=slices.golden_value,
        budget=spent,
        error=error,
        headroom=headroom,
        # A change is certain to be flagged only once its estimate, at its lower bound,
        # leaves the budget.
        sensitivity=spent.sensitivity * margin,
        baseline_headroom=baseline_headroom,
        notes=notes,
        exact_elements=slices.shape[0],
    )


def relative_baseline_error(baseline: torch.Tensor | Sketch, golden: torch.Tensor | Sketch,
                            metric: Metric, scale: float) -> float:
    """err(baseline, golden) / scale over the elements both have finite; estimated at its
    upper confidence bound (in RMS) when either is sketched."""
    if scale <= 0:
        return 0.0
    if involves_sketch(baseline, golden):
        reference = golden if isinstance(golden, Sketch) else baseline
        g, b = sketching.like(reference, golden), sketching.like(reference, baseline)
        return sketching.error_estimate(b, g) * tolerance.sketch_margin(g.size) / scale
    g, b = as_float64(golden), as_float64(baseline)
    usable = g.isfinite() & b.isfinite()
    if not bool(usable.all()):
        g, b = g[usable], b[usable]
    return tolerance.error(b, g, metric) / scale
