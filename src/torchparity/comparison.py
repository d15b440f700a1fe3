"""The comparison engine: verdicts and metrics for a candidate against a golden and a baseline.

:func:`compare` walks three pytrees of identical structure (tensors inside dicts, lists, tuples,
namedtuples, dataclasses or Hugging Face ``ModelOutput`` objects), compares every tensor under
the tolerance model of :mod:`torchparity.tolerance` and returns a :class:`Comparison`.
It knows nothing of models: any callable's outputs can be compared.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from torchparity import tolerance
from torchparity.tolerance import Budget, DtypeLike

Verdict = Literal["identical", "within", "diverged"]
_VERDICT_ORDER = {"identical": 0, "within": 1, "diverged": 2}

#: Relative errors divide by max(|golden|, RELATIVE_GUARD * absmax(golden)), so elements near
#: zero report their error relative to the tensor's scale instead of exploding.
RELATIVE_GUARD = 1e-3

_ROOT = "outputs"
_NO_BASELINE = object()


class StructureMismatch(ValueError):
    """Candidate, golden and baseline differ in structure, shape, dtype or a non-tensor leaf.

    The message names the path in Python syntax (``outputs["logits"][1]``) and both sides.
    """


@dataclass
class TensorComparison:
    """The comparison of one tensor: metrics of candidate vs golden, budget and verdict.

    Metrics are computed in float64 over the elements where candidate and golden are finite.
    An element is *over* when its absolute error exceeds ``budget.value``; for max-abs kinds
    that is exactly when the verdict is ``diverged``, for RMS kinds it counts the outliers.
    """

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
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; non-finite floats become the strings "inf" and "nan"."""
        data = dataclasses.asdict(self)
        data["worst_index"] = list(self.worst_index) if self.worst_index is not None else None
        data["shape"] = list(self.shape)
        return _json_safe(data)


@dataclass
class Comparison:
    """The comparison of a whole pytree: one :class:`TensorComparison` per tensor."""

    kind: str
    tensors: list[TensorComparison]

    @property
    def verdict(self) -> Verdict:
        """The worst verdict over all tensors (``identical`` when there are none)."""
        return max((t.verdict for t in self.tensors), key=_VERDICT_ORDER.get, default="identical")

    @property
    def ok(self) -> bool:
        """True when no tensor diverged."""
        return self.verdict != "diverged"

    @property
    def worst(self) -> TensorComparison | None:
        """The tensor that used the largest share of its budget (None without tensors)."""
        return max(self.tensors, key=_severity, default=None)

    def __bool__(self) -> bool:
        return self.ok

    def __repr__(self) -> str:
        worst = self.worst
        where = f", worst={worst.path} headroom={worst.headroom:.3g}" if worst else ""
        n = len(self.tensors)
        return f"Comparison(verdict={self.verdict!r}, kind={self.kind!r}, tensors={n}{where})"

    def explain(self) -> str:
        """One paragraph: verdict, worst tensor and index, the three values there, error versus
        budget with the formula's numbers, headroom, dtype and kind."""
        worst = self.worst
        if worst is None:
            return f"identical: no tensors to compare (kind {self.kind})."
        n = len(self.tensors)
        if self.verdict == "identical":
            reference = "baseline" if worst.baseline_value is not None else "golden"
            text = (
                f"identical: all {n} tensor(s) are bit-equal to the {reference}"
                f" (kind {self.kind}, compute dtype {worst.compute_dtype})."
            )
        elif self.verdict == "diverged":
            n_diverged = _count_verdicts(self.tensors)["diverged"]
            text = f"diverged: {n_diverged} of {n} tensor(s) diverged; worst {_describe(worst)}"
        else:
            text = f"within: all {n} tensor(s) within budget; closest to it {_describe(worst)}"
        others = [f"{t.path}: {note}" for t in self.tensors if t is not worst for note in t.notes]
        if self.verdict == "identical":
            others = [f"{t.path}: {note}" for t in self.tensors for note in t.notes]
        return text + (f" Also: {'; '.join(others)}." if others else "")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary with every tensor's metrics."""
        worst = self.worst
        return {
            "verdict": self.verdict,
            "ok": self.ok,
            "kind": self.kind,
            "worst": worst.path if worst else None,
            "tensors": [t.to_dict() for t in self.tensors],
        }


def compare(
    candidate: Any,
    golden: Any,
    baseline: Any = None,
    kind: str = "forward",
    *,
    compute_dtype: DtypeLike | None = None,
    reduction_length: int | None = None,
    step: int | None = None,
) -> Comparison:
    """Compare ``candidate`` with ``golden`` under the budget that ``baseline`` earns.

    The three are tensors or pytrees of the same structure; the golden may have a wider float
    dtype than the candidate, the baseline must have the candidate's. Non-tensor leaves must be
    equal. ``compute_dtype`` (default: each candidate tensor's dtype) sets the unit roundoff,
    ``reduction_length`` (default: each tensor's last dimension) the analytic bound, ``step``
    the growth of trajectory budgets; see :mod:`torchparity.tolerance`.

    Raises :class:`StructureMismatch` naming the path when the structures, shapes or dtypes
    differ, and ``ValueError`` for an unknown kind or dtype. The inputs are not modified.
    """
    tol = tolerance.kind_tolerance(kind)
    baseline_tree = _NO_BASELINE if baseline is None else baseline
    leaves = list(_aligned_leaves(candidate, golden, baseline_tree, _ROOT))
    scales = _group_scales(leaves, tol.metric) if tol.group_scale else {}
    tensors = [
        _compare_tensor(
            path, c, g, b, kind, compute_dtype, reduction_length, step, scales.get(path)
        )
        for path, c, g, b in leaves
    ]
    return Comparison(kind=kind, tensors=tensors)


def assert_parity(
    candidate: Any, golden: Any, baseline: Any = None, kind: str = "forward", **kwargs: Any
) -> Comparison:
    """Like :func:`compare`, but raise ``AssertionError(explain())`` when a tensor diverged."""
    result = compare(candidate, golden, baseline, kind, **kwargs)
    if not result.ok:
        raise AssertionError(result.explain())
    return result


# --- structure ------------------------------------------------------------------------------


def _aligned_leaves(
    candidate: Any, golden: Any, baseline: Any, path: str
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Yield (path, candidate, golden, baseline) per tensor; check everything else matches."""
    candidate, golden = _as_tensor(candidate), _as_tensor(golden)
    has_baseline = baseline is not _NO_BASELINE
    if has_baseline:
        baseline = _as_tensor(baseline)
    if isinstance(golden, torch.Tensor) or isinstance(candidate, torch.Tensor):
        _check_tensors(path, candidate, golden, "golden")
        if has_baseline:
            _check_tensors(path, candidate, baseline, "baseline")
            _check_dtype_equal(path, candidate, baseline)
        yield path, candidate, golden, baseline if has_baseline else None
        return
    c_children = _children(candidate)
    g_children = _children(golden)
    _check_same_children(path, candidate, golden, c_children, g_children, "golden")
    if has_baseline:
        b_children = _children(baseline)
        _check_same_children(path, candidate, baseline, c_children, b_children, "baseline")
    if c_children is None:
        _check_leaf_equal(path, candidate, golden, "golden")
        if has_baseline:
            _check_leaf_equal(path, candidate, baseline, "baseline")
        return
    for key, g_child in g_children.items():
        b_child = b_children[key] if has_baseline else _NO_BASELINE
        yield from _aligned_leaves(c_children[key], g_child, b_child, path + key)


def _as_tensor(x: Any) -> Any:
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def _children(x: Any) -> dict[str, Any] | None:
    """Map path suffix (``["key"]``, ``[0]``, ``.field``) to child; None for a non-tensor leaf."""
    if isinstance(x, Mapping):  # dicts, OrderedDicts and ModelOutput (an OrderedDict subclass)
        return {_key_syntax(k): v for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return {f".{name}": getattr(x, name) for name in x._fields}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f".{f.name}": getattr(x, f.name) for f in dataclasses.fields(x)}
    if isinstance(x, list | tuple):
        return {f"[{i}]": v for i, v in enumerate(x)}
    return None


def _key_syntax(key: Any) -> str:
    # json.dumps quotes like the examples in messages and docs: outputs["logits"].
    return f"[{json.dumps(key)}]" if isinstance(key, str) else f"[{key!r}]"


def _container_type(x: Any) -> str:
    # Mappings of any class align by keys, so a ModelOutput compares with a dict of goldens.
    return "mapping" if isinstance(x, Mapping) else type(x).__name__


def _check_same_children(
    path: str,
    candidate: Any,
    other: Any,
    c_children: dict[str, Any] | None,
    o_children: dict[str, Any] | None,
    side: str,
) -> None:
    if (c_children is None) != (o_children is None) or (
        c_children is not None and _container_type(candidate) != _container_type(other)
    ):
        raise _mismatch(path, "type", type(candidate).__name__, type(other).__name__, side)
    if c_children is None or c_children.keys() == o_children.keys():
        return
    if isinstance(candidate, list | tuple) and not hasattr(candidate, "_fields"):
        raise _mismatch(path, "length", len(candidate), len(other), side)
    missing = [k for k in o_children if k not in c_children]
    extra = [k for k in c_children if k not in o_children]
    parts = [f"{path}{k}: in {side}, missing in candidate" for k in missing]
    parts += [f"{path}{k}: in candidate, missing in {side}" for k in extra]
    raise StructureMismatch("; ".join(parts))


def _check_tensors(path: str, candidate: Any, other: Any, side: str) -> None:
    if not isinstance(candidate, torch.Tensor) or not isinstance(other, torch.Tensor):
        raise _mismatch(path, "type", type(candidate).__name__, type(other).__name__, side)
    if candidate.shape != other.shape:
        raise _mismatch(path, "shape", tuple(candidate.shape), tuple(other.shape), side)
    if _dtype_family(candidate.dtype) != _dtype_family(other.dtype):
        raise _mismatch(path, "dtype", candidate.dtype, other.dtype, side)


def _check_dtype_equal(path: str, candidate: torch.Tensor, baseline: torch.Tensor) -> None:
    if candidate.dtype != baseline.dtype:
        raise StructureMismatch(
            f"{path}: dtype {candidate.dtype} vs {baseline.dtype} (candidate vs baseline); "
            "the baseline must be computed in the candidate's dtype"
        )


def _dtype_family(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "integer"


def _check_leaf_equal(path: str, candidate: Any, other: Any, side: str) -> None:
    both_nan = isinstance(candidate, float) and isinstance(other, float)
    both_nan = both_nan and math.isnan(candidate) and math.isnan(other)
    if type(candidate) is not type(other) or (candidate != other and not both_nan):
        raise _mismatch(path, "value", repr(candidate), repr(other), side)


def _mismatch(path: str, what: str, candidate: Any, other: Any, side: str) -> StructureMismatch:
    return StructureMismatch(f"{path}: {what} {candidate} vs {other} (candidate vs {side})")


def _group_of(path: str) -> str:
    """The group of a leaf: for a parameter name the block that owns its module
    ("layers.0.attn" for "layers.0.attn.q_proj.weight": the attention's projections share their
    reductions), or the module itself for a top-level one ("lm_head"); else its container."""
    container, _, key = path.rpartition("[")
    parts = key.removesuffix("]").strip('"').split(".")
    if len(parts) < 2:
        return container
    return f"{container}[{'.'.join(parts[:-2] or parts[:-1])}]"


def _group_scales(
    leaves: list[tuple[str, Any, Any, Any]], metric: tolerance.Metric
) -> dict[str, float]:
    """The scale of each floating leaf's group: the largest golden magnitude among its members
    (see :data:`torchparity.tolerance.KINDS`, ``group_scale``). A group that cancelled as a
    whole (a module all of whose gradients vanish, e.g. the queries' path when every key is the
    same) takes the scale of the whole comparison, by the same rule one level up."""
    own = {path: tolerance.finite_magnitude(g, metric)
           for path, _, g, _ in leaves if g.dtype.is_floating_point}
    group: dict[str, float] = {}
    for path, scale in own.items():
        group[_group_of(path)] = max(group.get(_group_of(path), 0.0), scale)
    overall = max(group.values(), default=0.0)
    group = {name: overall if tolerance.cancelled(scale, overall) else scale
             for name, scale in group.items()}
    return {path: group[_group_of(path)] or None for path in own}


# --- one tensor -----------------------------------------------------------------------------


def _compare_tensor(
    path: str,
    candidate: torch.Tensor,
    golden: torch.Tensor,
    baseline: torch.Tensor | None,
    kind: str,
    compute_dtype: DtypeLike | None,
    reduction_length: int | None,
    step: int | None,
    group_scale: float | None = None,
) -> TensorComparison:
    if candidate.dtype.is_complex:
        raise StructureMismatch(f"{path}: complex tensors are not supported ({candidate.dtype})")
    c, g = _float64(candidate), _float64(golden)
    b = _float64(baseline) if baseline is not None else None
    reference = baseline if baseline is not None else golden
    if not candidate.dtype.is_floating_point:
        return _compare_exact(path, candidate, reference, kind, c, g, b)

    if tolerance.all_finite(c) and tolerance.all_finite(g):
        valid, faults, fault_notes, matched_notes = None, None, [], []
        c_valid, g_valid, g_finite_part = c.flatten(), g.flatten(), g
    else:
        c_finite, g_finite = c.isfinite(), g.isfinite()
        faults, fault_notes, matched_notes = _nonfinite(c, g, c_finite, g_finite)
        valid = c_finite & g_finite
        c_valid, g_valid, g_finite_part = c[valid], g[valid], g[g_finite]
    abs_err = (c_valid - g_valid).abs()
    metric = tolerance.kind_tolerance(kind).metric
    baseline_error, baseline_notes = _baseline_error(b, g, valid, metric)
    precision = tolerance.precision(compute_dtype if compute_dtype is not None else candidate.dtype)
    spent = tolerance.budget(
        g_finite_part,
        baseline_error=baseline_error,
        compute_dtype=precision.name,
        kind=kind,
        reduction_length=reduction_length if reduction_length is not None else _last_dim(g),
        step=step,
        group_scale=group_scale,
    )
    metrics = _metrics(c_valid, g_valid, abs_err, precision.name)
    err = metrics[metric]
    n_over = int((abs_err > spent.value).sum()) + (int(faults.sum()) if fault_notes else 0)
    if fault_notes:
        verdict, headroom, worst_index = "diverged", math.inf, _first_index(faults)
    else:
        headroom = err / spent.value
        worst_index = _worst_index(abs_err, valid, c.shape) if abs_err.numel() else None
        if _bit_equal(candidate, reference):
            verdict = "identical"
        else:
            verdict = "within" if err <= spent.value else "diverged"
    return TensorComparison(
        path=path,
        shape=tuple(candidate.shape),
        dtype=_dtype_name(candidate.dtype),
        compute_dtype=precision.name,
        kind=kind,
        verdict=verdict,
        **metrics,
        n_over=n_over,
        frac_over=_fraction(n_over, c.numel()),
        worst_index=worst_index,
        **_values_at(worst_index, c, b, g),
        budget=spent,
        error=err,
        headroom=headroom,
        notes=fault_notes + matched_notes + baseline_notes,
    )


def _compare_exact(
    path: str,
    candidate: torch.Tensor,
    reference: torch.Tensor,
    kind: str,
    c: torch.Tensor,
    g: torch.Tensor,
    b: torch.Tensor | None,
) -> TensorComparison:
    """Integer and bool tensors (token ids, masks) carry no rounding: they must match exactly."""
    abs_err = (c - g).abs()
    differ = abs_err > 0
    n_differ = int(differ.sum())
    if _bit_equal(candidate, reference):
        verdict = "identical"
    else:
        verdict = "diverged" if n_differ else "within"
    worst_index = _first_index(differ) if n_differ else None
    metrics = _metrics(c.flatten(), g.flatten(), abs_err.flatten(), None)
    return TensorComparison(
        path=path,
        shape=tuple(candidate.shape),
        dtype=_dtype_name(candidate.dtype),
        compute_dtype=None,
        kind=kind,
        verdict=verdict,
        **metrics,
        n_over=n_differ,
        frac_over=_fraction(n_differ, differ.numel()),
        worst_index=worst_index,
        **_values_at(worst_index, c, b, g),
        budget=None,
        error=metrics["max_abs"],
        headroom=math.inf if n_differ else 0.0,
        notes=[f"{n_differ} element(s) differ; exact tensors must match"] if n_differ else [],
    )


def _float64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def _last_dim(t: torch.Tensor) -> int:
    return max(t.shape[-1], 1) if t.dim() > 0 else 1


def _nonfinite(
    c: torch.Tensor, g: torch.Tensor, c_finite: torch.Tensor, g_finite: torch.Tensor
) -> tuple[torch.Tensor, list[str], list[str]]:
    """Positions where candidate and golden disagree on being finite, and what to say about it.

    Returns the mask of faults, the messages for faults (each one diverges the tensor) and the
    notes on matching non-finite values (same position, same kind), which are excluded from the
    metrics but reported.
    """
    same = (c.isnan() & g.isnan()) | (~c_finite & (c == g))
    faults = (c_finite != g_finite) | (~c_finite & ~g_finite & ~same)
    messages = []
    for label, mask in (("NaN", c.isnan()), ("inf", c.isinf())):
        n = int((mask & g_finite).sum())
        if n:
            messages.append(f"candidate has {n} {label} where golden is finite")
    n = int((c_finite & ~g_finite).sum())
    if n:
        messages.append(f"candidate is finite at {n} position(s) where golden is NaN or inf")
    n = int((~c_finite & ~g_finite & ~same).sum())
    if n:
        messages.append(f"candidate has {n} NaN/inf of another kind than the golden's")
    notes = []
    for label, mask in (("NaN", c.isnan()), ("inf", c.isinf())):
        n = int((mask & same).sum())
        if n:
            notes.append(f"{n} matching {label} in candidate and golden excluded from the metrics")
    return faults, messages, notes


def _baseline_error(
    b: torch.Tensor | None, g: torch.Tensor, valid: torch.Tensor | None, metric: tolerance.Metric
) -> tuple[float | None, list[str]]:
    """err(baseline, golden) over the elements where candidate, golden and baseline are finite.

    ``valid`` is the mask of elements where candidate and golden are finite (None: all are).
    """
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
    """Metrics of candidate vs golden over flat float64 tensors of the compared elements.

    Without a compute dtype (integer tensors) the ULP distance is the plain difference.
    """
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
    return max(-1.0, min(1.0, torch.dot(c, g).item() / scale))


_BITS_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype and the same bits everywhere (so NaN equals NaN and -0.0 differs from 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.dtype.is_floating_point:
        a, b = a.view(_BITS_VIEW[a.element_size()]), b.view(_BITS_VIEW[b.element_size()])
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- reporting ------------------------------------------------------------------------------


def _severity(t: TensorComparison) -> tuple[int, float]:
    return _VERDICT_ORDER[t.verdict], t.headroom


def _count_verdicts(tensors: list[TensorComparison]) -> dict[str, int]:
    counts = dict.fromkeys(_VERDICT_ORDER, 0)
    for t in tensors:
        counts[t.verdict] += 1
    return counts


def _describe(t: TensorComparison) -> str:
    """The worst tensor's sentence of :meth:`Comparison.explain`."""
    where = f"{t.path}"
    if t.worst_index is not None:
        values = f"candidate {t.candidate_value:.8g}"
        if t.baseline_value is not None:
            values += f", baseline {t.baseline_value:.8g}"
        values += f", golden {t.golden_value:.8g}"
        where += f" at index {t.worst_index} ({values})"
    if t.budget is None:
        body = f"{where}: {t.n_over} of {math.prod(t.shape)} element(s) differ"
        return f"{body}; {t.dtype} tensors must match exactly (kind {t.kind})."
    if math.isinf(t.headroom):
        body = f"{where}: {'; '.join(t.notes)}"
    else:
        label = "max-abs" if t.budget.metric == "max_abs" else "RMS"
        relation = "exceeds" if t.verdict == "diverged" else "is within"
        body = (
            f"{where}: {label} error {t.error:.3g} {relation} the budget {t.budget.value:.3g}"
            f" = {t.budget.formula()}, using {_share(t.headroom)};"
            f" {t.n_over} of {math.prod(t.shape)} element(s) over budget"
        )
        if t.notes:
            body += f"; {'; '.join(t.notes)}"
    return f"{body}. Compute dtype {t.compute_dtype} ({t.dtype} tensor), kind {t.kind}."


def _share(headroom: float) -> str:
    return f"{headroom:.0%} of it" if headroom < 10 else f"{headroom:.3g} times it"


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_json_safe(v) for v in x]
    return x
