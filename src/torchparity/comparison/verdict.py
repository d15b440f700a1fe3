"""The verdict on a whole pytree and its explanation: :func:`compare` and :func:`assert_parity`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torchparity import sketching, tolerance
from torchparity.comparison.groups import (
    group_noises,
    group_scales,
    likely_residues,
    residue_rounding,
)
from torchparity.comparison.selection import LeftOut, PaddingSpec, left_out_of, sentence
from torchparity.comparison.settings import Settings
from torchparity.comparison.sketch import compare_sketch, involves_sketch
from torchparity.comparison.structure import (
    ROOT,
    Leaf,
    Leaves,
    ShapeDifference,
    StructureDifference,
    TreeAlignment,
    align_trees,
    baseline_at,
    format_shape,
    numbers_dtype,
    tensor_leaves,
)
from torchparity.comparison.tensor import (
    VERDICT_ORDER,
    TensorComparison,
    Verdict,
    compare_tensor,
    json_safe,
    rerun_spread,
)
from torchparity.sketching import Sketch
from torchparity.tolerance import DtypeLike

#: The verdict of a comparison in which candidate and golden share no tensor: nothing was
#: judged, so it is never "identical" and never passes.
NOT_COMPARED = "not compared"


@dataclass
class Comparison:
    """The comparison of a whole pytree: per shared tensor a :class:`TensorComparison`, the shape
    and structure differences, and the leaves skipped (``(path, reason)``).

    A shape difference diverges; a structure difference is no divergence; where nothing is
    shared while one side holds tensors the verdict is :data:`NOT_COMPARED` and ``ok`` False."""

    kind: str
    tensors: list[TensorComparison]
    structure: tuple[StructureDifference, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    atol: float = 0.0
    rtol: float = 0.0
    shapes: tuple[ShapeDifference, ...] = ()

    @property
    def compared(self) -> bool:
        """False when one side holds tensors but they share none; no tensors at all differ in
        nothing."""
        return bool(self.tensors or self.shapes or not self.structure)

    @property
    def verdict(self) -> Verdict | str:
        """``diverged`` when a shape differs, :data:`NOT_COMPARED` when nothing is shared, else the
        worst tensor's (``identical`` when neither holds one)."""
        if self.shapes:
            return "diverged"
        if not self.compared:
            return NOT_COMPARED
        return max((t.verdict for t in self.tensors), key=VERDICT_ORDER.get, default="identical")

    @property
    def ok(self) -> bool:
        """Something was compared, nothing diverged and no baseline was degraded."""
        return self.verdict not in ("diverged", NOT_COMPARED) and not self.baseline_degraded

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
        if self.shapes:
            where += f", shapes_differ={len(self.shapes)}"
        if self.structure:
            where += f", structure_differs=True ({len(self.structure)} path(s))"
        if self.skipped:
            where += f", skipped={len(self.skipped)}"
        return f"Comparison(verdict={self.verdict!r}, kind={self.kind!r}, tensors={n}{where})"

    def explain(self) -> str:
        """One paragraph: verdict, shape differences, the worst tensor with its values, error
        against budget with the formula's numbers, headroom, dtype and kind."""
        if not self.shapes:
            return self._explain_tensors()
        shapes = "; ".join(f"{d.path}: {format_shape(d.candidate)} vs {format_shape(d.golden)}"
                           for d in self.shapes)
        text = (f"diverged: shape differs at {len(self.shapes)} path(s) (candidate vs golden): "
                f"{shapes}.")
        if self.tensors:
            text += f" The tensors of equal shape: {self._explain_tensors()}"
        else:
            text += self._context()
        return text

    def _explain_tensors(self) -> str:
        worst = self.worst
        if worst is None:
            if self.structure:
                return (f"{NOT_COMPARED}: candidate and golden share no tensors to compare "
                        f"(kind {self.kind})." + self._context())
            return f"identical: neither side holds a tensor (kind {self.kind})." + self._context()
        n = len(self.tensors)
        verdict = max((t.verdict for t in self.tensors), key=VERDICT_ORDER.get)
        if verdict == "identical":
            to_golden = worst.baseline_value is None or all(t.error == 0 for t in self.tensors)
            reference = "golden" if to_golden else "baseline"
            text = (
                f"identical: all {n} tensor(s) are bit-equal to the {reference}"
                f" (kind {self.kind}, compute dtype {worst.compute_dtype})."
            )
            if self.sensitivity is not None:
                text += f" {_sensitivity_sentence(self.sensitivity)}."
        elif verdict == "diverged":
            n_diverged = _count_verdicts(self.tensors)["diverged"]
            text = f"diverged: {n_diverged} of {n} tensor(s) diverged; worst {_describe(worst)}"
        else:
            text = f"within: all {n} tensor(s) within budget; closest to it {_describe(worst)}"
        others = _notes([t for t in self.tensors if t is not worst or verdict == "identical"])
        if self.baseline_degraded and verdict != "diverged":
            text = ("baseline degraded, a failure of the baseline and no divergence of the"
                    f" candidate, which is {text}")
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
        left_out = self.left_out_sentence()
        if left_out:
            parts.append(left_out)
        return "".join(f" {part}" for part in parts)

    @property
    def left_out(self) -> list[TensorComparison]:
        """The tensors some of whose positions were left out of the judgement (padding)."""
        return [t for t in self.tensors if t.left_out]

    def left_out_sentence(self) -> str | None:
        """The sentence of :meth:`explain` on the positions left out and why (None: none)."""
        left_out = self.left_out
        if not left_out:
            return None
        return sentence([(t.path, t.left_out, t.positions, t.left_out_reason) for t in left_out])

    @property
    def sensitivity(self) -> float | None:
        """The largest sensitivity over the compared float tensors: the smallest flagged change as a
        share of the golden's scale (None without one)."""
        return max((t.sensitivity for t in self.tensors if t.sensitivity is not None), default=None)

    @property
    def baseline_degraded(self) -> bool:
        """Whether any tensor's baseline erred more than its dtype allows."""
        return any(t.baseline_degraded for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary: tensors' metrics, differences, skipped leaves, tolerances
        added by hand."""
        worst = self.worst
        return json_safe({
            "verdict": self.verdict,
            "ok": self.ok,
            "kind": self.kind,
            "sensitivity": self.sensitivity,
            "baseline_degraded": self.baseline_degraded,
            "worst": worst.path if worst else None,
            "shapes": [dataclasses.asdict(d) for d in self.shapes],
            "structure_differs": self.structure_differs,
            "structure": [dataclasses.asdict(d) for d in self.structure],
            "skipped": [{"path": path, "reason": reason} for path, reason in self.skipped],
            "atol": self.atol,
            "rtol": self.rtol,
            "left_out": [{"path": t.path, "positions": t.left_out, "of": t.positions,
                          "reason": t.left_out_reason} for t in self.left_out],
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
    reruns: Sequence[Any] = (),
    noise: float | None = None,
    padding: PaddingSpec = None,
    islands: DtypeLike | None = None,
) -> Comparison:
    """Compare ``candidate`` with ``golden`` under the budget that ``baseline`` earns.

    Every tensor the three hold at one path (pytrees, see :func:`shared_tensors`; Python
    numbers as 0-d tensors), in one shape and kind of dtype, is judged; bit-equal is
    ``identical``. Another shape is a :class:`ShapeDifference` (``diverged``); another
    structure a :class:`StructureDifference`, the verdict staying the shared tensors'; leaves
    not compared (``transformers`` caches, see :data:`CACHE_RULE`; unregistered objects)
    are in :attr:`Comparison.skipped`. A :class:`~torchparity.sketching.Sketch` on any side
    stands for its tensor (a padded one with its padding at 0). Integers and bools match
    exactly; NaN as in ``torch.testing.assert_close``; masked entries (at or below
    :data:`~torchparity.tolerance.MASKED_BELOW`) are judged apart and set no scale. A
    baseline that errs more than a plain computation in its dtype may
    (:func:`~torchparity.tolerance.baseline_bound`) is *degraded*: it sets no budget, and
    :attr:`Comparison.baseline_degraded` says so. The inputs are not modified.

    Args:
        candidate: the tensors judged (a tensor, number or pytree).
        golden: the reference, as precise as possible (float64; may be wider than the
            candidate).
        baseline: the trusted implementation, holding the shared tensors in the candidate's
            shape and dtype, whose error sets the noise; None: the analytic bound.
        kind: a kind of :data:`torchparity.tolerance.KINDS` (forward, grad, loss, ...).
        compute_dtype: the dtype whose roundoff counts (default: each tensor's own; Python
            floats: the most precise among the candidate's tensors, else float64).
        reduction_length: the analytic bound's K (default: each tensor's last dimension).
        step: a trajectory's step, which grows its budget (:mod:`torchparity.tolerance`).
        equal_nan: NaN in both at one position agrees.
        atol: added to every floating tensor's budget, by hand (the report says so).
        rtol: times the golden's scale in the kind's metric, added likewise.
        reruns: the candidate computed again on weights moved by one rounding
            (:func:`torchparity.subject.rounding.perturb_weights`): their spread is its own
            rounding, whatever its kernel does (FlashAttention's recomputed backward), while
            a bug cancels; each tensor's noise is at least that spread, up to what a plain
            computation in its dtype allows. Needs a baseline.
        noise: every compared tensor's noise, estimated elsewhere (for a loss,
            :func:`~torchparity.tolerance.propagated_noise` of its outputs: one baseline
            draw of a scalar can be lucky by 50x). Needs a baseline.
        padding: the positions left out of the error, the scale, gradient groups and the
            non-finite check: a bool mask, True at padding, over a tensor's leading
            dimensions, or ``(path, golden) -> LeftOut | None``
            (:class:`torchparity.subject.padding.Padding`).
        islands: the narrowest dtype the model computes in whatever its own
            (:mod:`torchparity.subject.islands`): the baseline may err as it may, and it
            floors every noise and budget.

    Returns:
        The :class:`Comparison`: a verdict per tensor, the structure's differences, the
        skipped leaves.

    Raises:
        StructureMismatch: the baseline or a rerun lacks a shared tensor or holds it in
            another shape or dtype.
        ValueError: an unknown kind or dtype, a negative ``atol``/``rtol``, reruns without
            a baseline, or a padding mask that is not bool or does not fit.
    """
    tol = tolerance.kind_tolerance(kind)
    for name, value in (("atol", atol), ("rtol", rtol)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if (reruns or noise is not None) and baseline is None:
        raise ValueError("reruns and noise refine the noise a baseline measures; pass the"
                         " baseline too")
    found = TreeAlignment()
    align_trees(candidate, golden, ROOT, found)
    baselines = None if baseline is None else tensor_leaves(baseline, ROOT, {})
    leaves = [
        (path, c, g, None if baselines is None else baseline_at(path, c, baselines))
        for path, c, g in found.pairs
    ]
    left_out = {path: left_out_of(padding, path, g) for path, _, g, _ in leaves}
    judged = [(path, *(_judged(t, left_out[path]) for t in tensors))
              for path, *tensors in leaves]
    floats_dtype = compute_dtype or numbers_dtype(leaves, found.numbers)

    settings = Settings(kind=kind, compute_dtype=compute_dtype,
                        reduction_length=reduction_length, step=step, equal_nan=equal_nan,
                        atol=atol, rtol=rtol, islands=islands)

    def settings_of(path: str, **found_by_group: Any) -> Settings:
        """The settings of one tensor: Python numbers take the floats' dtype."""
        dtype = floats_dtype if path in found.numbers else compute_dtype
        return dataclasses.replace(settings, compute_dtype=dtype, **found_by_group)

    scales = group_scales(judged, tol.metric) if tol.group_scale else {}
    rerun_leaves = [tensor_leaves(r, ROOT, {}) for r in reruns]
    spreads = {
        path: None if involves_sketch(c, g, b) else rerun_spread(
            c_judged, g_judged,
            [_judged(baseline_at(path, c, r), left_out[path]) for r in rerun_leaves],
            settings_of(path, group_scale=scales.get(path)),
        )
        for (path, c, g, b), (_, c_judged, g_judged, _) in zip(leaves, judged, strict=True)
    }
    noises = group_noises(judged, tol.metric, scales, spreads) if tol.group_scale else {}

    def judge(path: str, c: Leaf, g: Leaf, b: Leaf | None, inherited: float = 0.0
              ) -> TensorComparison:
        tensor_settings = settings_of(path, group_scale=scales.get(path),
                                      group_noise=noises.get(path), inherited=inherited)
        if involves_sketch(c, g, b):
            return _compare_sketched(path, c, g, b, tensor_settings, left_out[path], noise)
        return compare_tensor(path, c, g, b, tensor_settings, spread=spreads[path],
                              input_noise=noise, left_out=left_out[path])

    residues = likely_residues(judged, tol.metric, scales, tol.residue_share) if scales else set()
    tensors = _judged_residues_first(leaves, judge, residues)
    return Comparison(
        kind=kind,
        tensors=tensors,
        structure=tuple(found.structure),
        skipped=tuple(found.skipped),
        atol=atol,
        rtol=rtol,
        shapes=tuple(found.shapes),
    )


def _judged_residues_first(leaves: Leaves, judge: Callable[..., TensorComparison],
                           residues: set[str]) -> list[TensorComparison]:
    """Every leaf judged, the likely ``residues`` first (their rounding reaches the other
    gradients, ``groups.residue_rounding``); if others show, all again by the rule itself."""
    first = {leaf[0]: judge(*leaf) for leaf in leaves if leaf[0] in residues}
    inherited = residue_rounding(list(first.values()))
    tensors = [first[leaf[0]] if leaf[0] in first else judge(*leaf, inherited)
               for leaf in leaves]
    if all(_is_residue(t) == (t.path in first) for t in tensors):
        return tensors
    tensors = [judge(*leaf) for leaf in leaves]
    if inherited := residue_rounding(tensors):
        tensors = [t if t.budget is None or t.budget.residue else judge(*leaf, inherited)
                   for t, leaf in zip(tensors, leaves, strict=True)]
    return tensors


def _is_residue(t: TensorComparison) -> bool:
    return t.budget is not None and t.budget.residue


def _judged(tensor: Leaf | None, left_out: LeftOut | None) -> Leaf | None:
    if left_out is None or tensor is None or isinstance(tensor, Sketch):
        return tensor
    return left_out.judged(tensor)


def _compare_sketched(path: str, candidate: Leaf, golden: Leaf, baseline: Leaf | None,
                      settings: Settings, left_out: LeftOut | None,
                      noise: float | None = None) -> TensorComparison:
    """A comparison with a sketch on some side; the exact sides are masked as a padded sketch
    was, so padding adds nothing."""
    if left_out is None:
        return compare_sketch(path, candidate, golden, baseline, settings, noise)
    sides = [v if v is None or isinstance(v, Sketch) else sketching.masked(v, left_out.mask)
             for v in (candidate, golden, baseline)]
    result = compare_sketch(path, *sides, settings, noise)
    return dataclasses.replace(result, left_out=left_out.positions, positions=left_out.total,
                               left_out_reason=left_out.reason)


def assert_parity(
    candidate: Any,
    golden: Any,
    baseline: Any = None,
    kind: str = "forward",
    *,
    allow_structure_changes: bool = False,
    **kwargs: Any,
) -> Comparison:
    """Like :func:`compare`, but raise ``AssertionError(explain())`` when a tensor diverged, or
    the structures differ unless ``allow_structure_changes``."""
    result = compare(candidate, golden, baseline, kind, **kwargs)
    if not result.ok or (result.structure_differs and not allow_structure_changes):
        raise AssertionError(result.explain())
    return result


# --- reporting ------------------------------------------------------------------------------


def _severity(t: TensorComparison) -> tuple[int, float]:
    return VERDICT_ORDER[t.verdict], t.headroom


def _count_verdicts(tensors: list[TensorComparison]) -> dict[str, int]:
    counts = dict.fromkeys(VERDICT_ORDER, 0)
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
        body = f"{where}: {t.n_over} of {_elements(t)} differ"
        return f"{body}; {t.dtype} tensors must match exactly (kind {t.kind})."
    if math.isinf(t.headroom):
        body = f"{where}: {'; '.join(t.notes)}"
    else:
        label = "max-abs" if t.budget.metric == "max_abs" else "RMS"
        relation = "exceeds" if t.error > t.budget.value else "is within"
        body = (
            f"{where}: {label} error {t.error:.3g} {relation} the budget {t.budget.value:.3g}"
            f" = {t.budget.formula()}, using {_share(t.headroom)};"
            f" {t.n_over} of {_elements(t)} over budget"
        )
        if t.notes:
            body += f"; {'; '.join(t.notes)}"
        body += f". {_sensitivity_sentence(t.sensitivity)}"
    return f"{body}. Compute dtype {t.compute_dtype} ({t.dtype} tensor), kind {t.kind}."


def _elements(t: TensorComparison) -> str:
    if t.exact_elements is not None:
        return f"the {t.exact_elements} exact element(s)"
    if not t.left_out:
        return f"{math.prod(t.shape)} element(s)"
    return f"{t.judged_elements} judged element(s)"


def _notes(tensors: list[TensorComparison]) -> list[str]:
    """Each tensor's notes as sentences; one shared by more than three tensors says how many and
    the first."""
    paths: dict[str, list[str]] = {}
    for t in tensors:
        for note in t.notes:
            paths.setdefault(note, []).append(t.path)
    sentences = []
    for note, where in paths.items():
        if len(where) > 3:
            sentences.append(f"{len(where)} tensors ({where[0]} and others): {note}")
        else:
            sentences += [f"{path}: {note}" for path in where]
    return sentences


def _sensitivity_sentence(sensitivity: float) -> str:
    return (
        f"It would have flagged a change of the output larger than {sensitivity:.2g} of the"
        " golden's scale"
    )


def _share(headroom: float) -> str:
    return f"{headroom:.0%} of it" if headroom < 10 else f"{headroom:.3g} times it"


