"""The comparison engine: verdicts and metrics for a candidate against a golden and a baseline.

:func:`compare` walks the candidate's and the golden's pytrees together (tensors and Python
numbers inside dicts, lists, tuples, namedtuples, dataclasses, Hugging Face ``ModelOutput``
objects or any container registered with ``torch.utils._pytree``), compares every tensor both
hold under the tolerance model of :mod:`torchparity.tolerance`, and reports where the two differ
in structure and which leaves it did not compare. It knows nothing of models: any callable's
outputs can be compared.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch.utils import _pytree as pytree

from torchparity import tolerance
from torchparity.tolerance import Budget, DtypeLike

Verdict = Literal["identical", "within", "diverged"]
_VERDICT_ORDER = {"identical": 0, "within": 1, "diverged": 2}

#: Relative errors divide by max(|golden|, RELATIVE_GUARD * absmax(golden)), so elements near
#: zero report their error relative to the tensor's scale instead of exploding.
RELATIVE_GUARD = 1e-3

_ROOT = "outputs"

#: Why a transformers cache is not compared (see :func:`compare`).
CACHE_RULE = (
    "a cache is decoding state laid out by its implementation; its contents are compared"
    " through the outputs of the steps that read it"
)


class StructureMismatch(ValueError):
    """The baseline cannot be aligned with the candidate, so no budget can be earned.

    Differences between candidate and golden are reported, not raised (see
    :attr:`Comparison.structure`). The baseline must hold a tensor of the candidate's shape and
    dtype wherever candidate and golden share one. The message names the path in Python syntax
    (``outputs["logits"][1]``) and both sides.
    """


@dataclass(frozen=True)
class StructureDifference:
    """A path where candidate and golden differ in structure, and what each side has there:
    ``"Tensor(2, 3) float32"``, ``"tuple of 2"``, ``"None"``, ``"missing"``, ``"int 3"``."""

    path: str
    candidate: str
    golden: str

    def __str__(self) -> str:
        return f"{self.path}: candidate {self.candidate}, golden {self.golden}"


@dataclass
class TensorComparison:
    """The comparison of one tensor: metrics of candidate vs golden, budget and verdict.

    Metrics are computed in float64 over the elements where candidate and golden are finite.
    An element is *over* when its absolute error exceeds ``budget.value``; for max-abs kinds
    that is exactly when the verdict is ``diverged``, for RMS kinds it counts the outliers.
    ``sensitivity`` is the smallest change relative to the golden's scale that the verdict would
    have flagged (``budget.value / budget.scale``); ``baseline_headroom`` the share the
    baseline's own error used of the larger of its dtype's bound and the kind's fudge times the
    candidate's error: over 1 the baseline is degraded and the tensor diverges.
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
    sensitivity: float | None  # budget / scale; None for exact (integer and bool) tensors
    baseline_headroom: float | None  # err(baseline) / its dtype's bound; None without baseline
    notes: list[str] = field(default_factory=list)

    @property
    def baseline_degraded(self) -> bool:
        """Whether the baseline erred more than its dtype allows."""
        return self.baseline_headroom is not None and self.baseline_headroom > 1

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; non-finite floats become the strings "inf" and "nan"."""
        data = dataclasses.asdict(self)
        data["worst_index"] = list(self.worst_index) if self.worst_index is not None else None
        data["shape"] = list(self.shape)
        return _json_safe(data)


@dataclass
class Comparison:
    """The comparison of a whole pytree: one :class:`TensorComparison` per tensor that candidate
    and golden share, the differences of structure between them, and the leaves not compared.

    ``verdict`` and ``ok`` judge the shared tensors alone; :attr:`structure_differs` says
    whether the structures differ. ``skipped`` holds ``(path, reason)`` pairs; ``atol`` and
    ``rtol`` are the tolerances a user added to every budget by hand (see :func:`compare`).
    """

    kind: str
    tensors: list[TensorComparison]
    structure: tuple[StructureDifference, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    atol: float = 0.0
    rtol: float = 0.0

    @property
    def verdict(self) -> Verdict:
        """The worst verdict over all tensors (``identical`` when there are none)."""
        return max((t.verdict for t in self.tensors), key=_VERDICT_ORDER.get, default="identical")

    @property
    def ok(self) -> bool:
        """True when no tensor diverged."""
        return self.verdict != "diverged"

    @property
    def structure_differs(self) -> bool:
        """True when candidate and golden differ in structure somewhere."""
        return bool(self.structure)

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
        if self.structure:
            where += f", structure_differs=True ({len(self.structure)} path(s))"
        if self.skipped:
            where += f", skipped={len(self.skipped)}"
        return f"Comparison(verdict={self.verdict!r}, kind={self.kind!r}, tensors={n}{where})"

    def explain(self) -> str:
        """One paragraph: verdict, worst tensor and index, the three values there, error versus
        budget with the formula's numbers, headroom, dtype and kind."""
        worst = self.worst
        if worst is None:
            nothing = "candidate and golden share no tensors" if self.structure else "no tensors"
            return f"identical: {nothing} to compare (kind {self.kind})." + self._context()
        n = len(self.tensors)
        if self.verdict == "identical":
            reference = "baseline" if worst.baseline_value is not None else "golden"
            text = (
                f"identical: all {n} tensor(s) are bit-equal to the {reference}"
                f" (kind {self.kind}, compute dtype {worst.compute_dtype})."
            )
            if self.sensitivity is not None:
                text += f" {_sensitivity_sentence(self.sensitivity)}."
        elif self.verdict == "diverged":
            n_diverged = _count_verdicts(self.tensors)["diverged"]
            text = f"diverged: {n_diverged} of {n} tensor(s) diverged; worst {_describe(worst)}"
        else:
            text = f"within: all {n} tensor(s) within budget; closest to it {_describe(worst)}"
        others = [f"{t.path}: {note}" for t in self.tensors if t is not worst for note in t.notes]
        if self.verdict == "identical":
            others = [f"{t.path}: {note}" for t in self.tensors for note in t.notes]
        return text + (f" Also: {'; '.join(others)}." if others else "") + self._context()

    def _context(self) -> str:
        """The sentences of :meth:`explain` on structure, skipped leaves and loosened budgets."""
        parts = []
        if self.structure:
            differences = "; ".join(str(d) for d in self.structure)
            parts.append(f"Structure differs at {len(self.structure)} path(s): {differences}.")
        if self.skipped:
            skipped = "; ".join(f"{path} ({reason})" for path, reason in self.skipped)
            parts.append(f"Not compared: {skipped}.")
        if self.atol or self.rtol:
            parts.append(
                f"Loosened by hand: atol {self.atol:g} + rtol {self.rtol:g} × scale added to"
                " every floating tensor's budget."
            )
        return "".join(f" {part}" for part in parts)

    @property
    def sensitivity(self) -> float | None:
        """The largest sensitivity over the compared float tensors: a change of any one tensor by
        more than this share of its golden's scale would have been flagged (None without one)."""
        return max((t.sensitivity for t in self.tensors if t.sensitivity is not None), default=None)

    @property
    def baseline_degraded(self) -> bool:
        """Whether any tensor's baseline erred more than its dtype allows."""
        return any(t.baseline_degraded for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary with every tensor's metrics, the structure differences,
        the skipped leaves and any tolerance added by hand."""
        worst = self.worst
        return _json_safe({
            "verdict": self.verdict,
            "ok": self.ok,
            "kind": self.kind,
            "sensitivity": self.sensitivity,
            "baseline_degraded": self.baseline_degraded,
            "worst": worst.path if worst else None,
            "structure_differs": self.structure_differs,
            "structure": [dataclasses.asdict(d) for d in self.structure],
            "skipped": [{"path": path, "reason": reason} for path, reason in self.skipped],
            "atol": self.atol,
            "rtol": self.rtol,
            "tensors": [t.to_dict() for t in self.tensors],
        })


def compare(
    candidate: Any,
    golden: Any,
    baseline: Any = None,
    kind: str = "forward",
    *,
    compute_dtype: DtypeLike | None = None,
    reduction_length: int | None = None,
    step: int | None = None,
    equal_nan: bool = False,
    atol: float = 0.0,
    rtol: float = 0.0,
) -> Comparison:
    """Compare ``candidate`` with ``golden`` under the budget that ``baseline`` earns.

    The three are tensors, Python numbers or pytrees of them (see :func:`shared_tensors` for the
    containers walked). Every tensor that candidate and golden hold at the same path, with the
    same shape and kind of dtype, is judged; the golden may have a wider float dtype than the
    candidate. Python numbers are judged as 0-d tensors: ints and bools exactly, floats in the
    compute dtype (below). Where the two differ in structure (a key or position missing on one
    side, ``None`` against a tensor, a tuple become a tensor, another shape, a string or other
    plain value that differs) a :class:`StructureDifference` is reported in
    :attr:`Comparison.structure`: ``verdict`` stays the verdict on the shared tensors. Leaves
    that are not compared are listed in :attr:`Comparison.skipped` with the reason:
    ``transformers`` caches (see :data:`CACHE_RULE`) and objects that are neither tensors,
    numbers, plain values nor containers (register them with ``torch.utils._pytree`` to compare
    their contents).

    ``baseline`` need only hold the shared tensors, each in the candidate's shape and dtype.
    ``compute_dtype`` (default: each candidate tensor's dtype) sets the unit roundoff; Python
    floats, which carry no dtype, take it when given, else the most precise floating dtype among
    the candidate's tensors (a float mostly comes out of them: ``loss.item()``), else float64.
    ``reduction_length`` (default: each tensor's last dimension) sets the analytic bound,
    ``step`` the growth of trajectory budgets; see :mod:`torchparity.tolerance`.

    NaN follows ``torch.testing.assert_close``: a NaN in the candidate fails even where the
    golden has NaN, unless ``equal_nan=True``; infinities of the same sign at the same position
    match. ``atol`` and ``rtol`` are the one way to loosen a comparison by hand: ``atol + rtol *
    scale`` (the golden's magnitude in the kind's metric) is added to every floating tensor's
    budget, and :meth:`Comparison.explain` and ``to_dict`` say so. Integer and bool tensors
    always match exactly.

    Raises :class:`StructureMismatch` naming the path when the baseline lacks a shared tensor
    or holds it in another shape or dtype, and ``ValueError`` for an unknown kind or dtype or a
    negative ``atol``/``rtol``. The inputs are not modified.
    """
    tol = tolerance.kind_tolerance(kind)
    for name, value in (("atol", atol), ("rtol", rtol)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    found = _Alignment()
    _align(candidate, golden, _ROOT, found)
    baselines = None if baseline is None else _tensor_leaves(baseline, _ROOT, {})
    leaves = [
        (path, c, g, None if baselines is None else _baseline_at(path, c, baselines))
        for path, c, g in found.pairs
    ]
    scales = _group_scales(leaves, tol.metric) if tol.group_scale else {}
    noises = _group_noises(leaves, tol.metric, scales) if tol.group_scale else {}
    numbers_dtype = compute_dtype or _numbers_dtype(leaves, found.numbers)
    tensors = [
        _compare_tensor(
            path, c, g, b, kind, numbers_dtype if path in found.numbers else compute_dtype,
            reduction_length, step, scales.get(path), equal_nan=equal_nan, atol=atol, rtol=rtol,
            group_noise=noises.get(path),
        )
        for path, c, g, b in leaves
    ]
    return Comparison(
        kind=kind,
        tensors=tensors,
        structure=tuple(found.structure),
        skipped=tuple(found.skipped),
        atol=atol,
        rtol=rtol,
    )


def assert_parity(
    candidate: Any,
    golden: Any,
    baseline: Any = None,
    kind: str = "forward",
    *,
    allow_structure_changes: bool = False,
    **kwargs: Any,
) -> Comparison:
    """Like :func:`compare`, but raise ``AssertionError(explain())`` when a tensor diverged or,
    unless ``allow_structure_changes=True``, when candidate and golden differ in structure (a
    refactor that stops returning attention weights, say, passes with it)."""
    result = compare(candidate, golden, baseline, kind, **kwargs)
    if not result.ok or (result.structure_differs and not allow_structure_changes):
        raise AssertionError(result.explain())
    return result


def shared_tensors(a: Any, b: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The tensors two pytrees share: ``(path, a's tensor, b's tensor)`` wherever both hold a
    tensor of the same shape and kind of dtype, in the order :func:`compare` judges them.

    Containers are mappings (``ModelOutput`` included, by key), lists and tuples (by position),
    namedtuples and dataclasses (by field) and anything registered with ``torch.utils._pytree``.
    The tensors are returned as given (still attached to their graphs), so a loss summed over
    them reaches only outputs both sides produce. Python numbers are left out.
    """
    found = _Alignment()
    _align(a, b, _ROOT, found)
    return [(path, x, y) for path, x, y in found.pairs if path not in found.numbers]


# --- structure ------------------------------------------------------------------------------


@dataclass
class _Alignment:
    """What walking candidate and golden together found: the (path, candidate, golden) tensors
    both hold, which of those paths were Python numbers, the differences, the skipped leaves."""

    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    numbers: set[str] = field(default_factory=set)
    structure: list[StructureDifference] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


_MISSING = object()  # the side of a key or position that only the other side has

# Leaves compared by equality: a difference is one of structure, not of rounding. (Ints reach
# this only beyond int64 or as enums; other numbers become tensors.)
_PLAIN_VALUES = (str, bytes, int, complex, enum.Enum, torch.dtype, torch.device)

_OPAQUE_RULE = (
    "not a tensor, number or container; register its class with torch.utils._pytree"
    " to compare its contents"
)


def _align(candidate: Any, golden: Any, path: str, found: _Alignment) -> None:
    """Walk candidate and golden together from ``path``, recording into ``found``."""
    c, g = _leaf_tensor(candidate), _leaf_tensor(golden)
    c_children, g_children = _children(candidate), _children(golden)
    if c is not None and g is not None and _same_layout(c, g):
        found.pairs.append((path, c, g))
        if _is_python_number(candidate):
            found.numbers.add(path)
    elif (
        c_children is not None
        and g_children is not None
        and _container_type(candidate) == _container_type(golden)
    ):
        for key in {**g_children, **c_children}:  # the golden's order, the candidate's extras
            _align(c_children.get(key, _MISSING), g_children.get(key, _MISSING), path + key, found)
    elif _is_cache(candidate) and _is_cache(golden):
        found.skipped.append((path, CACHE_RULE))
    elif _is_opaque(candidate) and type(candidate) is type(golden):
        found.skipped.append((path, f"{type(candidate).__name__}: {_OPAQUE_RULE}"))
    elif not _same_value(candidate, golden):
        found.structure.append(StructureDifference(path, _what(candidate), _what(golden)))


def _leaf_tensor(x: Any) -> torch.Tensor | None:
    """A tensor, array or number as a tensor (floats as float64); None for anything else."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray | np.number | np.bool_):
        return torch.from_numpy(np.asarray(x))
    if isinstance(x, bool):
        return torch.tensor(x)
    if isinstance(x, float):
        return torch.tensor(x, dtype=torch.float64)
    if _is_python_number(x) and -(2**63) <= x < 2**63:  # larger ints stay plain values
        return torch.tensor(x, dtype=torch.int64)
    return None


def _is_python_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, enum.Enum)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and _dtype_family(a.dtype) == _dtype_family(b.dtype)


def _same_value(a: Any, b: Any) -> bool:
    """None and plain values (strings, dtypes, enums, ...) are compared by equality."""
    return (a is None or isinstance(a, _PLAIN_VALUES)) and type(a) is type(b) and a == b


def _is_cache(x: Any) -> bool:
    """A ``transformers`` cache (DynamicCache, StaticCache, EncoderDecoderCache, ...), recognised
    by its base class without importing transformers."""
    return any(
        cls.__name__ == "Cache" and cls.__module__.startswith("transformers")
        for cls in type(x).__mro__
    )


def _is_opaque(x: Any) -> bool:
    """An object compare cannot look into: no tensor, number, plain value or container."""
    return (
        x is not None
        and x is not _MISSING
        and not isinstance(x, _PLAIN_VALUES)
        and _leaf_tensor(x) is None
        and _children(x) is None
    )


def _children(x: Any) -> dict[str, Any] | None:
    """Map path suffix (``["key"]``, ``[0]``, ``.field``) to child; None for a leaf."""
    if isinstance(x, torch.Tensor) or _is_cache(x):
        return None
    if isinstance(x, Mapping):  # dicts, OrderedDicts and ModelOutput (an OrderedDict subclass)
        return {_key_syntax(k): v for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return {f".{name}": getattr(x, name) for name in x._fields}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f".{f.name}": getattr(x, f.name) for f in dataclasses.fields(x)}
    if isinstance(x, list | tuple):
        return {f"[{i}]": v for i, v in enumerate(x)}
    node = pytree.SUPPORTED_NODES.get(type(x))
    if node is None:
        return None
    if node.flatten_with_keys_fn is None:
        values, _ = node.flatten_fn(x)
        return {f"[{i}]": v for i, v in enumerate(values)}
    entries, _ = node.flatten_with_keys_fn(x)
    return {_entry_syntax(entry): v for entry, v in entries}


def _key_syntax(key: Any) -> str:
    # json.dumps quotes like the examples in messages and docs: outputs["logits"].
    return f"[{json.dumps(key)}]" if isinstance(key, str) else f"[{key!r}]"


def _entry_syntax(entry: Any) -> str:
    return _key_syntax(entry.key) if isinstance(entry, pytree.MappingKey) else str(entry)


def _container_type(x: Any) -> str:
    # Mappings of any class align by keys (a ModelOutput with a dict of goldens), lists and
    # tuples by position; other containers only with their own class.
    if isinstance(x, Mapping):
        return "mapping"
    if isinstance(x, list | tuple) and not hasattr(x, "_fields"):
        return "sequence"
    return type(x).__name__


def _what(x: Any) -> str:
    """What one side has at a path: "Tensor(2, 3) float32", "tuple of 2", "None", "missing",
    "float 1.5", "str 'mean'", "DynamicCache"."""
    if x is _MISSING:
        return "missing"
    if x is None:
        return "None"
    if isinstance(x, _PLAIN_VALUES) or _is_python_number(x):
        text = repr(x)
        if len(text) > _MAX_VALUE_CHARS:
            text = text[: _MAX_VALUE_CHARS - 3] + "..."
        return f"{type(x).__name__} {text}"
    tensor = _leaf_tensor(x)
    if tensor is not None:
        name = "Tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        return f"{name}({', '.join(map(str, tensor.shape))}) {_dtype_name(tensor.dtype)}"
    children = _children(x)
    if children is not None:
        return f"{type(x).__name__} of {len(children)}"
    return type(x).__name__


_MAX_VALUE_CHARS = 40


def _tensor_leaves(tree: Any, path: str, leaves: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every tensor and number of ``tree`` by path (the baseline's, looked up per shared path)."""
    tensor = _leaf_tensor(tree)
    if tensor is not None:
        leaves[path] = tensor
        return leaves
    for key, child in (_children(tree) or {}).items():
        _tensor_leaves(child, path + key, leaves)
    return leaves


def _baseline_at(
    path: str, candidate: torch.Tensor, baselines: dict[str, torch.Tensor]
) -> torch.Tensor:
    baseline = baselines.get(path)
    if baseline is None:
        raise StructureMismatch(
            f"{path}: missing in the baseline; it must hold every tensor that candidate and"
            " golden share"
        )
    if candidate.shape != baseline.shape:
        raise _mismatch(path, "shape", tuple(candidate.shape), tuple(baseline.shape), "baseline")
    if candidate.dtype != baseline.dtype:
        raise StructureMismatch(
            f"{path}: dtype {candidate.dtype} vs {baseline.dtype} (candidate vs baseline); "
            "the baseline must be computed in the candidate's dtype"
        )
    return baseline


def _numbers_dtype(leaves: list[tuple[str, Any, Any, Any]], numbers: set[str]) -> torch.dtype:
    """The compute dtype of Python floats: the most precise floating dtype among the
    candidate's tensors, else float64."""
    dtypes = [
        c.dtype for path, c, _, _ in leaves if path not in numbers and c.dtype.is_floating_point
    ]
    return min(dtypes, key=tolerance.unit_roundoff, default=torch.float64)


def _dtype_family(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "integer"


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


def _group_noises(
    leaves: list[tuple[str, Any, Any, Any]], metric: tolerance.Metric, scales: dict[str, float]
) -> dict[str, float]:
    """The relative noise every floating leaf with a baseline shares: the largest
    err(baseline) / scale among them, each against its group's scale. The gradients of one
    backward pass round through the same loss gradient, which can itself cancel (a confident
    prediction: p - onehot), so one member's relative error is every member's; see
    :func:`torchparity.tolerance.budget`."""
    relative = 0.0
    members = []
    for path, _, g, b in leaves:
        if b is None or not g.dtype.is_floating_point:
            continue
        g, b = _float64(g), _float64(b)
        usable = g.isfinite() & b.isfinite()
        if not bool(usable.all()):
            g, b = g[usable], b[usable]
        # Relative to the group's scale: a member far smaller than its module carries the
        # module's rounding, which says nothing of the pass's.
        scale = max(tolerance.finite_magnitude(g, metric), scales.get(path) or 0.0)
        members.append(path)
        if scale > 0:
            relative = max(relative, tolerance.error(b, g, metric) / scale)
    return dict.fromkeys(members, relative)


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
    *,
    equal_nan: bool = False,
    atol: float = 0.0,
    rtol: float = 0.0,
    group_noise: float | None = None,
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
        faults, fault_notes, matched_notes = _nonfinite(c, g, c_finite, g_finite, equal_nan)
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
        group_noise=group_noise,
        atol=atol,
        rtol=rtol,
    )
    metrics = _metrics(c_valid, g_valid, abs_err, precision.name)
    err = metrics[metric]
    n_over = int((abs_err > spent.value).sum()) + (int(faults.sum()) if fault_notes else 0)
    baseline_headroom = None
    if baseline_error is not None:
        bound = tolerance.baseline_bound(
            g_finite_part,
            compute_dtype=precision.name,
            kind=kind,
            reduction_length=spent.reduction_length,
            group_scale=group_scale,
        )
        # A problem that amplifies rounding (a gradient that cancels to 1e-5 of the terms it
        # sums) may take any baseline past the bound; only a candidate in the same dtype doing
        # fudge times better shows that the baseline lost precision the problem does not cost.
        fudge = tolerance.kind_tolerance(kind).fudge
        baseline_headroom = baseline_error / max(bound, fudge * err)
        if baseline_headroom > 1:
            baseline_notes.append(
                f"the baseline itself errs {baseline_error:.3g}, over the {bound:.3g} a"
                f" plain {precision.name} computation may err and over {fudge:g} times the"
                " candidate's error; the baseline is degraded (a softmax or reduction in a"
                " narrower dtype, a lost upcast?) and cannot set a budget"
            )
    if fault_notes:
        verdict, headroom, worst_index = "diverged", math.inf, _first_index(faults)
    else:
        headroom = err / spent.value
        worst_index = _worst_index(abs_err, valid, c.shape) if abs_err.numel() else None
        if baseline_headroom is not None and baseline_headroom > 1:
            verdict = "diverged"
        elif _bit_equal(candidate, reference):
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
        sensitivity=spent.sensitivity,
        baseline_headroom=baseline_headroom,
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
        sensitivity=None,
        baseline_headroom=None,
        notes=[f"{n_differ} element(s) differ; exact tensors must match"] if n_differ else [],
    )


def _float64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


def _last_dim(t: torch.Tensor) -> int:
    return max(t.shape[-1], 1) if t.dim() > 0 else 1


def _nonfinite(
    c: torch.Tensor,
    g: torch.Tensor,
    c_finite: torch.Tensor,
    g_finite: torch.Tensor,
    equal_nan: bool,
) -> tuple[torch.Tensor, list[str], list[str]]:
    """Positions where candidate and golden disagree on being finite, and what to say about it.

    Returns the mask of faults, the messages for faults (each one diverges the tensor) and the
    notes on matching non-finite values (same position, same kind), which are excluded from the
    metrics but reported. As in ``torch.testing.assert_close``, NaN matches NaN only with
    ``equal_nan``.
    """
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
        relation = "exceeds" if t.error > t.budget.value else "is within"
        body = (
            f"{where}: {label} error {t.error:.3g} {relation} the budget {t.budget.value:.3g}"
            f" = {t.budget.formula()}, using {_share(t.headroom)};"
            f" {t.n_over} of {math.prod(t.shape)} element(s) over budget"
        )
        if t.notes:
            body += f"; {'; '.join(t.notes)}"
        body += f". {_sensitivity_sentence(t.sensitivity)}"
    return f"{body}. Compute dtype {t.compute_dtype} ({t.dtype} tensor), kind {t.kind}."


def _sensitivity_sentence(sensitivity: float) -> str:
    return (
        f"It would have flagged a change of the output larger than {sensitivity:.2g} of the"
        " golden's scale"
    )


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
