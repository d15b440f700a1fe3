"""Judging one tensor: its budget under the tolerance model, its metrics, worst element and
verdict."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from torchparity import tolerance
from torchparity.comparison.selection import LeftOut
from torchparity.comparison.settings import Settings
from torchparity.comparison.structure import StructureMismatch, torch_dtype_name
from torchparity.tolerance import Budget

Verdict = Literal["identical", "within", "diverged"]
VERDICT_ORDER = {"identical": 0, "within": 1, "diverged": 2}

#: Relative errors divide by max(|golden|, RELATIVE_GUARD * absmax(golden)), so elements near
#: zero report their error relative to the tensor's scale instead of exploding.
RELATIVE_GUARD = 1e-3


@dataclass
class TensorComparison:
    """The comparison of one tensor: metrics of candidate vs golden, budget and verdict.

    Metrics are float64 over the elements both hold finite and judged (``left_out`` of the
    ``positions`` are padding). An element is *over* past ``budget.value`` (max-abs kinds:
    exactly when diverged; RMS: outliers). ``sensitivity`` is the smallest flagged change
    relative to the scale; ``baseline_headroom``: the baseline's error as a share of the larger
    of its dtype's bound and fudge times the candidate's (over 1: degraded, the tensor
    diverges)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    compute_dtype: str | None  # None for integer and bool tensors, which must match exactly
    kind: str
    verdict: Verdict
    max_abs: float
    max_rel: float
    rms: float
    rel_l2: float
    cosine: float
    max_ulp: float
    n_over: int
    frac_over: float
    worst_index: tuple[int, ...] | None
    candidate_value: float | None
    baseline_value: float | None
    golden_value: float | None
    budget: Budget | None
    error: float  # the kind's metric of candidate - golden
    headroom: float  # error / budget: the share of the budget used (inf for non-finite faults)
    sensitivity: float | None  # budget / scale; None for exact (integer and bool) tensors
    baseline_headroom: float | None  # err(baseline) / its dtype's bound; None without baseline
    notes: list[str] = field(default_factory=list)
    # A sketched tensor (comparison/sketch.py) counts ``n_over`` among its exact slices only.
    exact_elements: int | None = None
    left_out: int = 0  # positions of the leading dimensions not judged (padding)
    positions: int = 0  # positions the mask that left them out covers (0 without one)
    left_out_reason: str | None = None  # why they were left out

    @property
    def judged_elements(self) -> int:
        """How many elements were judged: all but those at the left-out positions."""
        elements = math.prod(self.shape)
        if not self.left_out:
            return elements
        return elements - elements // self.positions * self.left_out

    @property
    def baseline_degraded(self) -> bool:
        """Whether the baseline erred more than its dtype allows."""
        return self.baseline_headroom is not None and self.baseline_headroom > 1

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; non-finite floats become the strings "inf" and "nan"."""
        data = dataclasses.asdict(self)
        data["worst_index"] = list(self.worst_index) if self.worst_index is not None else None
        data["shape"] = list(self.shape)
        return json_safe(data)


def compare_tensor(
    path: str,
    candidate: torch.Tensor,
    golden: torch.Tensor,
    baseline: torch.Tensor | None,
    settings: Settings,
    *,
    spread: float | None = None,
    input_noise: float | None = None,
    left_out: LeftOut | None = None,
) -> TensorComparison:
    """Judge one tensor under ``settings``; ``left_out`` positions count in neither error nor
    scale, and a non-finite value there is no fault.

    Where ``settings.islands`` is coarser than the compute dtype, its guard and floors apply;
    a degraded baseline sets no budget; bit-equal is ``identical`` whatever the baseline did."""
    if candidate.dtype.is_complex:
        raise StructureMismatch(f"{path}: complex tensors are not supported ({candidate.dtype})")
    c, g = as_float64(candidate), as_float64(golden)
    b = as_float64(baseline) if baseline is not None else None
    reference = baseline if baseline is not None else golden
    kind = settings.kind
    if not candidate.dtype.is_floating_point:
        return _compare_exact(path, candidate, golden, baseline, kind, left_out)

    keep = None if left_out is None else left_out.keep(c.shape)
    if keep is not None:  # left-out elements become equal zeros: no fault, and not counted
        c, g = c.where(keep, 0.0), g.where(keep, 0.0)
        b = None if b is None else b.where(keep, 0.0)
    masked = _masked(c, g)
    if keep is None and masked is None and tolerance.all_finite(c) and tolerance.all_finite(g):
        valid, faults, fault_notes, matched_notes = None, None, [], []
        c_valid, g_valid, g_finite_part = c.flatten(), g.flatten(), g
    else:
        c_finite, g_finite, faults, fault_notes, matched_notes = _set_apart(
            c, g, masked, settings.equal_nan)
        counted = g_finite if keep is None else g_finite & keep
        valid = c_finite & counted
        c_valid, g_valid, g_finite_part = c[valid], g[valid], g[counted]
    abs_err = (c_valid - g_valid).abs()
    metric = tolerance.kind_tolerance(kind).metric
    baseline_error, baseline_notes = _baseline_error(b, g, valid, metric)
    precision = tolerance.precision(settings.compute_dtype if settings.compute_dtype is not None
                                    else candidate.dtype)
    bound_dtype = tolerance.coarser(precision.name, settings.islands)
    length = settings.reduction_length if settings.reduction_length is not None else _last_dim(g)
    metrics = _metrics(c_valid, g_valid, abs_err, precision.name)
    err = metrics[metric]
    baseline_headroom = None
    if baseline_error is not None:
        bound = tolerance.baseline_bound(
            g_finite_part,
            compute_dtype=bound_dtype,
            kind=kind,
            reduction_length=length,
            group_scale=settings.group_scale,
        )
        baseline_headroom = tolerance.baseline_headroom(baseline_error, bound, err, kind)
        if baseline_headroom > 1:
            baseline_notes.append(degraded_note(baseline_error, bound, bound_dtype, kind))
    degraded = baseline_headroom is not None and baseline_headroom > 1
    # A degraded baseline cannot set the budget: the bound of a plain computation does.
    spent = tolerance.budget(tolerance.Measurement(
        g_finite_part, baseline_error=None if degraded else baseline_error,
        compute_dtype=precision.name, kind=kind, reduction_length=length, step=settings.step,
        group_scale=settings.group_scale, group_noise=settings.group_noise, spread=spread,
        input_noise=input_noise, inherited=settings.inherited, atol=settings.atol,
        rtol=settings.rtol, islands=settings.islands))
    n_over = int((abs_err > spent.value).sum()) + (int(faults.sum()) if fault_notes else 0)
    if fault_notes:
        verdict, headroom, worst_index = "diverged", math.inf, _first_index(faults)
    else:
        headroom = err / spent.value
        worst_index = _worst_index(abs_err, valid, c.shape) if abs_err.numel() else None
        if (_bit_equal(candidate, reference, keep) and not degraded) or _bit_equal(
                candidate, golden, keep):
            verdict = "identical"
        else:
            verdict = "within" if err <= spent.value else "diverged"
    return TensorComparison(
        path=path,
        shape=tuple(candidate.shape),
        dtype=torch_dtype_name(candidate.dtype),
        compute_dtype=precision.name,
        kind=kind,
        verdict=verdict,
        **metrics,
        n_over=n_over,
        frac_over=_fraction(n_over, c.numel() if keep is None else int(keep.sum())),
        worst_index=worst_index,
        **_values_at(worst_index, c, b, g),
        budget=spent,
        error=err,
        headroom=headroom,
        sensitivity=spent.sensitivity,
        baseline_headroom=baseline_headroom,
        notes=fault_notes + matched_notes + baseline_notes,
        **_left_out_fields(left_out),
    )


def degraded_note(baseline_error: float, bound: float, dtype: str, kind: str,
                  measure: str = "") -> str:
    """What a comparison says of a baseline over its bound (``tolerance.baseline_headroom``)."""
    fudge = tolerance.kind_tolerance(kind).fudge
    return (f"the baseline itself errs {measure}{baseline_error:.3g}, over the {bound:.3g} a"
            f" plain {dtype} computation may err and over {fudge:g} times the candidate's"
            " error: the baseline is degraded (a softmax or reduction in a narrower dtype, a"
            " lost upcast?) and sets no budget; the analytic bound does")


def _compare_exact(
    path: str,
    candidate: torch.Tensor,
    golden: torch.Tensor,
    baseline: torch.Tensor | None,
    kind: str,
    left_out: LeftOut | None,
) -> TensorComparison:
    """Integer and bool tensors (token ids, masks) carry no rounding: they must match exactly."""
    c, g = as_float64(candidate), as_float64(golden)
    b = as_float64(baseline) if baseline is not None else None
    reference = baseline if baseline is not None else golden
    keep = None if left_out is None else left_out.keep(c.shape)
    abs_err = (c - g).abs()
    differ = abs_err > 0 if keep is None else (abs_err > 0) & keep
    n_differ = int(differ.sum())
    # Identical means bit-equal to the baseline *and* equal to the golden (a baseline that
    # differs from the golden cannot make a candidate that repeats it identical), or
    # bit-equal to the golden itself.
    if n_differ:
        verdict = "diverged"
    else:
        same = _bit_equal(candidate, reference, keep) or _bit_equal(candidate, golden, keep)
        verdict = "identical" if same else "within"
    worst_index = _first_index(differ) if n_differ else None
    judged = (lambda t: t.flatten()) if keep is None else (lambda t: t[keep])
    metrics = _metrics(judged(c), judged(g), judged(abs_err), None)
    return TensorComparison(
        path=path,
        shape=tuple(candidate.shape),
        dtype=torch_dtype_name(candidate.dtype),
        compute_dtype=None,
        kind=kind,
        verdict=verdict,
        **metrics,
        n_over=n_differ,
        frac_over=_fraction(n_differ, differ.numel() if keep is None else int(keep.sum())),
        worst_index=worst_index,
        **_values_at(worst_index, c, b, g),
        budget=None,
        error=metrics["max_abs"],
        headroom=math.inf if n_differ else 0.0,
        sensitivity=None,
        baseline_headroom=None,
        notes=[f"{n_differ} element(s) differ; exact tensors must match"] if n_differ else [],
        **_left_out_fields(left_out),
    )


def rerun_spread(
    candidate: torch.Tensor,
    golden: torch.Tensor,
    reruns: list[torch.Tensor],
    settings: Settings,
) -> float | None:
    """The candidate's own rounding: its largest difference from its reruns (None without), each
    capped at what a plain computation may err (``tolerance.baseline_bound``)."""
    if not reruns or not golden.dtype.is_floating_point:
        return None
    c = as_float64(candidate)
    metric = tolerance.kind_tolerance(settings.kind).metric
    spreads = []
    for rerun in reruns:
        r = as_float64(rerun)
        usable = c.isfinite() & r.isfinite()
        spreads.append(tolerance.error(r[usable], c[usable], metric))
    g = as_float64(golden)
    bound = tolerance.baseline_bound(
        g[g.isfinite()], compute_dtype=settings.compute_dtype or candidate.dtype,
        kind=settings.kind, reduction_length=settings.reduction_length
        if settings.reduction_length is not None else _last_dim(g),
        group_scale=settings.group_scale,
    )
    return min(max(spreads), bound)


def _left_out_fields(left_out: LeftOut | None) -> dict[str, Any]:
    if left_out is None:
        return {}
    return dict(left_out=left_out.positions, positions=left_out.total,
                left_out_reason=left_out.reason)


def as_float64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def _last_dim(t: torch.Tensor) -> int:
    return max(t.shape[-1], 1) if t.dim() > 0 else 1


def _masked(c: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Which entries are masked (at or below ``tolerance.MASKED_BELOW``, -inf included); or None."""
    if not c.numel() or (c.amin().item() > tolerance.MASKED_BELOW
                         and g.amin().item() > tolerance.MASKED_BELOW):
        return None  # the common case, in two reductions (a NaN minimum falls through too)
    c_masked, g_masked = c <= tolerance.MASKED_BELOW, g <= tolerance.MASKED_BELOW
    return (c_masked, g_masked) if bool(c_masked.any() or g_masked.any()) else None


def _set_apart(
    c: torch.Tensor,
    g: torch.Tensor,
    masked: tuple[torch.Tensor, torch.Tensor] | None,
    equal_nan: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str], list[str]]:
    """Elements judged apart from metrics and scale: non-finite and masked ones (masked on both
    sides agrees). Returns the elements judged by value, the faults and the notes."""
    if masked is None:
        c_finite, g_finite = c.isfinite(), g.isfinite()
        return c_finite, g_finite, *_nonfinite(c, g, c_finite, g_finite, equal_nan)
    c_masked, g_masked = masked
    apart = c_masked | g_masked
    c, g = c.masked_fill(apart, 0.0), g.masked_fill(apart, 0.0)  # the rest judges finiteness
    c_finite, g_finite = c.isfinite() & ~apart, g.isfinite() & ~apart
    faults, fault_notes, matched_notes = _nonfinite(c, g, c_finite, g_finite, equal_nan)
    below = f"<= {tolerance.MASKED_BELOW:g}"
    for side, only, other in (("candidate", c_masked & ~g_masked, "golden"),
                              ("golden", g_masked & ~c_masked, "candidate")):
        if only.any():
            fault_notes.append(f"the {side} masks {int(only.sum())} element(s) ({below}) "
                               f"where the {other} has a value")
    both = int((c_masked & g_masked).sum())
    if both:
        matched_notes.append(f"{both} element(s) masked ({below}) in candidate and golden "
                             "judged apart from the metrics")
    return c_finite, g_finite, faults | (c_masked ^ g_masked), fault_notes, matched_notes


def _nonfinite(
    c: torch.Tensor,
    g: torch.Tensor,
    c_finite: torch.Tensor,
    g_finite: torch.Tensor,
    equal_nan: bool,
) -> tuple[torch.Tensor, list[str], list[str]]:
    """Positions where candidate and golden disagree on being finite: the faults' mask and
    messages, and notes on matching non-finite values (NaN matches NaN only with ``equal_nan``)."""
    both_nan = c.isnan() & g.isnan()
    same = (both_nan & equal_nan) | (~c_finite & (c == g))
    faults = (c_finite != g_finite) | (~c_finite & ~g_finite & ~same)
    messages = []
    for label, mask in (("NaN", c.isnan()), ("inf", c.isinf())):
        n = int((mask & g_finite).sum())
        if n:
            messages.append(f"candidate has {n} {label} where golden is finite")
    n = int((c_finite & ~g_finite).sum())
    if n:
        messages.append(f"candidate is finite at {n} position(s) where golden is NaN or inf")
    n = int((~c_finite & ~g_finite & ~same & ~both_nan).sum())
    if n:
        messages.append(f"candidate has {n} NaN/inf of another kind than the golden's")
    n = 0 if equal_nan else int(both_nan.sum())
    if n:
        messages.append(
            f"candidate has {n} NaN where golden has NaN too; pass equal_nan=True to accept them"
        )
    notes = []
    for label, mask in (("NaN", c.isnan()), ("inf", c.isinf())):
        n = int((mask & same).sum())
        if n:
            notes.append(f"{n} matching {label} in candidate and golden excluded from the metrics")
    return faults, messages, notes


def _baseline_error(
    b: torch.Tensor | None, g: torch.Tensor, valid: torch.Tensor | None, metric: tolerance.Metric
) -> tuple[float | None, list[str]]:
    """err(baseline, golden) where all three are finite (``valid``: candidate and golden are)."""
    if b is None:
        return None, []
    if valid is None and tolerance.all_finite(b):
        return tolerance.error(b, g, metric), []
    b_finite = b.isfinite()
    broken = int((~b_finite & g.isfinite()).sum())
    usable = b_finite if valid is None else valid & b_finite
    notes = [f"baseline has {broken} NaN/inf where golden is finite"] if broken else []
    return tolerance.error(b[usable], g[usable], metric), notes


def _metrics(
    c: torch.Tensor, g: torch.Tensor, abs_err: torch.Tensor, compute_dtype: str | None
) -> dict[str, float]:
    """Metrics of candidate vs golden over flat float64 tensors (without a compute dtype, the ULP
    distance is the plain difference)."""
    if abs_err.numel() == 0:
        return dict(max_abs=0.0, max_rel=0.0, rms=0.0, rel_l2=0.0, cosine=1.0, max_ulp=0.0)
    g_abs = g.abs()
    g_absmax, g_rms, c_rms = g_abs.max().item(), tolerance.rms(g), tolerance.rms(c)
    rel = abs_err / g_abs.clamp(min=RELATIVE_GUARD * (g_absmax or 1.0))
    rms = tolerance.rms(abs_err)
    spacing = tolerance.ulp(g_abs, compute_dtype) if compute_dtype is not None else 1.0
    return dict(
        max_abs=abs_err.max().item(),
        max_rel=rel.max().item(),
        rms=rms,
        rel_l2=rms / max(g_rms, RELATIVE_GUARD * (g_rms or 1.0)),
        cosine=_cosine(c, g, c_rms, g_rms),
        max_ulp=(abs_err / spacing).max().item(),
    )


def _cosine(c: torch.Tensor, g: torch.Tensor, c_rms: float, g_rms: float) -> float:
    if c_rms == 0 or g_rms == 0:
        return 1.0 if c_rms == g_rms else 0.0
    scale = c_rms * g_rms * c.numel()
    if not tolerance.SAFE_NORMS[0] < scale < tolerance.SAFE_NORMS[1]:
        # Normalise first: the product of two tiny or huge norms would underflow or overflow.
        c, g, scale = c / c_rms, g / g_rms, c.numel()
    return max(-1.0, min(1.0, tolerance.dot(c, g) / scale))


_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bit_equal(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor | None = None) -> bool:
    """Same dtype and bits wherever ``keep`` (NaN equals NaN, -0.0 differs from 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype.is_floating_point:
        a, b = a.view(_BITS_VIEW[a.element_size()]), b.view(_BITS_VIEW[b.element_size()])
    if keep is not None:
        a, b = a[keep], b[keep]
    return torch.equal(a, b)


def _worst_index(
    abs_err: torch.Tensor, valid: torch.Tensor | None, shape: torch.Size
) -> tuple[int, ...]:
    """Index (in the full tensor) of the largest error among the compared elements."""
    flat = int(abs_err.argmax())
    if valid is not None:
        flat = int(valid.flatten().nonzero()[flat])
    return tuple(int(i) for i in np.unravel_index(flat, tuple(shape)))


def _first_index(mask: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in mask.nonzero()[0])


def _values_at(
    index: tuple[int, ...] | None, c: torch.Tensor, b: torch.Tensor | None, g: torch.Tensor
) -> dict[str, float | None]:
    if index is None:
        return dict(candidate_value=None, baseline_value=None, golden_value=None)
    return dict(
        candidate_value=c[index].item(),
        baseline_value=b[index].item() if b is not None else None,
        golden_value=g[index].item(),
    )


def _fraction(n: int, total: int) -> float:
    return n / total if total else 0.0


def json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x
