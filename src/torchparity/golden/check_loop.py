"""One check loop for every subject: a zoo case, a user's model, a training trajectory.

Changed weights or inputs turn every row into ``init changed`` or ``inputs changed``. Otherwise
the **reference cell** is judged against a rerun on weights moved by one float64 rounding, every
other cell against the golden with ``manual`` in its dtype and device as baseline. Once the
reference cell diverged (the model's math changed, and the baselines carry it), the other cells
are judged against this revision's own float64 as well, so a backend problem still stands out. A
subject feeds the loop a :class:`Feed`; the loop owns the order, the baselines and the rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from torchparity import backends, sketching, tolerance
from torchparity.comparison import NOT_COMPARED, Comparison
from torchparity.golden.cells import BOTH_GOLDENS, REFERENCE, Cell, CellRun, CheckResult
from torchparity.golden.compiled_cells import annotate, step_verdicts, unavailable_reason
from torchparity.golden.store import Golden, GoldenStore
from torchparity.sketching import Sketch
from torchparity.subject.compiling import CompileFailed

#: ``cell_done(label)``: a cell is done.
CellDone = Callable[[str], None]


class Feed(Protocol):
    """What one subject gives the check loop."""

    #: The rows' ``case``: the zoo case, the model or the trajectory's case.
    name: str
    #: Output -> kind of the tolerance model, for every output a row may name.
    kinds: Mapping[str, str]
    #: The outputs every cell judges, in the order of the rows.
    outputs: Sequence[str]
    #: Outputs n/a in every cell, and why.
    unjudged: Mapping[str, str]
    #: The output whose errors the loss's sensitivity carries into the loss.
    noise_from: str
    #: Where the reference cell writes what it obtained for an output that fails.
    store: GoldenStore

    def changed(self) -> dict[str, tuple[str, str]]:
        """Per output made from other weights or inputs: ``{output: (verdict, reason)}``."""

    def refused(self, cell: Cell) -> str | None:
        """Why ``cell`` cannot run this subject at all (not even its baseline), or None."""

    def run(self, cell: Cell, *, perturb: bool = False) -> CellRun:
        """The subject run in ``cell``; ``perturb``: on weights moved by one float64 rounding."""

    def golden(self, output: str) -> Any:
        """The golden of ``output``: its stored values, or None."""

    def judge(self, cell: Cell, output: str, candidate: Any, golden: Any, baseline: Any,
              noise: float | None = None) -> CheckResult:
        """The row of ``output`` in ``cell``: the candidate against the golden.

        ``baseline``'s error sets the budget (None: the analytic bound alone); ``noise`` is what
        the outputs' errors carry into the loss.
        """

    def self_checks(self, fresh: CellRun) -> list[CheckResult]:
        """Rows the reference run judges by itself (a cached decoding against its recompute)."""

    def steps(self, decoded: Any) -> list[dict[str, torch.Tensor]]:
        """A decoding's outputs as one ``{path: tensor}`` per step (compiled: judged each)."""


def check_cells(feed: Feed, cells: list[Cell], advance: CellDone = lambda label: None,
                model_changed: bool = False) -> list[CheckResult]:
    """One row per cell and output, the reference cell first, in cell then output order.

    ``model_changed``: the reference cell, checked in another run, diverged: these cells are
    judged against today's float64 as well.
    """
    results: list[CheckResult] = []
    if changed := feed.changed():
        for cell in cells:
            results += [row(feed, cell, output, verdict, ok=False, reason=reason)
                        for output, (verdict, reason) in changed.items()]
            advance(cell.label)
        return results
    baselines: dict[tuple[str, str], CellRun] = {}
    # This revision's float64 outputs, once they diverged.
    own = feed.run(REFERENCE) if model_changed and REFERENCE not in cells else None
    for cell in sorted(cells, key=lambda cell: cell != REFERENCE):
        if cell == REFERENCE:
            rows, fresh = _check_reference(feed)
            results += rows
            if any(r.verdict == "diverged" for r in rows if r.output in feed.outputs):
                own = fresh
        elif (refused := feed.refused(cell)) is not None:
            results += [row(feed, cell, output, "n/a", ok=True, reason=refused)
                        for output in feed.outputs]
        else:
            key = (cell.dtype, cell.device)
            if key not in baselines:
                baselines[key] = feed.run(Cell("manual", *key))
            results += _check_cell(feed, cell, baselines[key], own)
        results += [row(feed, cell, output, "n/a", ok=True, reason=reason)
                    for output, reason in feed.unjudged.items()]
        advance(cell.label)
    return results


def _check_reference(feed: Feed) -> tuple[list[CheckResult], CellRun]:
    """The reference cell: today's float64 against the goldens, and today's run."""
    fresh = feed.run(REFERENCE)
    # baseline golden + (perturbed - fresh): a backward-stable computation is exact for weights
    # moved that much, so its distance is the noise float64 cannot avoid (other BLAS, other torch),
    # while a change of the math stands far out; failing outputs get their .obtained file
    perturbed = feed.run(REFERENCE, perturb=True)
    results = []
    for output in feed.outputs:
        if output in fresh.not_compared:
            results.append(row(feed, REFERENCE, output, NOT_COMPARED, ok=False,
                               reason=fresh.not_compared[output]))
            continue
        if output in fresh.missing:
            results.append(row(feed, REFERENCE, output, "n/a", ok=True,
                               reason=fresh.missing[output]))
            continue
        candidate, golden = fresh.outputs.get(output, {}), feed.golden(output)
        moved = perturbed.outputs.get(output, {})
        baseline = {path: sketching.shifted(golden[path], moved[path], tensor)
                    if tensor.is_floating_point() else golden[path]
                    for path, tensor in candidate.items() if path in golden and path in moved}
        result = feed.judge(REFERENCE, output, candidate, golden, baseline)
        if not result.ok:
            feed.store.write_obtained(feed.name, output, candidate)
        results.append(result)
    return results + feed.self_checks(fresh), fresh


def _check_cell(feed: Feed, cell: Cell, baseline: CellRun, own: CellRun | None
                ) -> list[CheckResult]:
    """The rows of ``cell`` against the goldens, and against ``own`` (today's float64) if given."""
    run = _cell_run(feed, cell, baseline)
    # A backend that rewrites SDPA calls has nothing to do in a model that makes none; the
    # manual backend compiled is the model's own code compiled, attention by hand or not.
    if run is not baseline and cell.backend != "manual" and run.sdpa_calls == 0:
        return [row(feed, cell, output, "n/a", ok=True, reason=backends.NO_SDPA_CALLS_REASON)
                for output in feed.outputs]
    results = []
    for output in feed.outputs:
        if output in run.not_compared:
            results.append(row(feed, cell, output, NOT_COMPARED, ok=False,
                               reason=run.not_compared[output]))
        elif output in run.missing:
            results.append(row(feed, cell, output, "n/a", ok=True, reason=run.missing[output]))
        else:
            noise = (loss_noise(baseline, feed.noise_from, feed.golden(feed.noise_from))
                     if output == "loss" else None)
            result = feed.judge(cell, output, run.outputs.get(output, {}),
                                feed.golden(output), baseline.outputs.get(output), noise)
            # A decoding is forced along the golden's tokens, which today's float64 run need
            # not have chosen: it is judged against the stored goldens only.
            if own is not None and output in own.outputs and output != "decode":
                noise = (loss_noise(baseline, feed.noise_from, own.outputs.get(feed.noise_from, {}))
                         if output == "loss" else None)
                result = _against_both(result, feed.judge(
                    cell, output, run.outputs.get(output, {}), own.outputs[output],
                    baseline.outputs.get(output), noise))
            results.append(result)
    if cell.compile:
        annotate(results, run.compile_log, step_verdicts(
            *(feed.steps(decoded) for decoded in (
                run.outputs.get("decode"), feed.golden("decode"),
                baseline.outputs.get("decode"))), cell.dtype))
    return results


def _against_both(stored: CheckResult, own: CheckResult) -> CheckResult:
    """A cell's row against both: the own float64's verdict, with the stored goldens' beside it."""
    own.judged_against = BOTH_GOLDENS
    own.stored_goldens = {"verdict": stored.verdict, "headroom": stored.headroom,
                          "sensitivity": stored.sensitivity}
    return own


def _cell_run(feed: Feed, cell: Cell, baseline: CellRun) -> CellRun:
    """The cell's run: the baseline itself for eager manual; all n/a where a compiled cell fails."""
    if not cell.compile:
        return baseline if cell.backend == "manual" else feed.run(cell)
    reason = unavailable_reason(cell)
    if reason is None:
        try:
            return feed.run(cell)
        except CompileFailed as exc:
            reason = str(exc)
    return CellRun({}, dict.fromkeys(feed.kinds, reason))


def loss_noise(baseline: CellRun, output: str, golden: Mapping[str, torch.Tensor | Sketch]
               ) -> float | None:
    """The noise the baseline's ``output`` carries into the loss (sketched ones none), or None."""
    outputs = baseline.outputs.get(output, {})
    errors = {path: outputs[path].double() - golden[path].double()
              for path in baseline.sensitivity if path in outputs and path in golden
              and not isinstance(outputs[path], sketching.Sketch)
              and not isinstance(golden[path], sketching.Sketch)}
    return tolerance.propagated_noise(baseline.sensitivity, errors) if errors else None


def checksum_changes(goldens: dict[str, Golden], now: Mapping[str, str | None],
                     advice: Callable[[str], str],
                     named: Callable[[], str | None] | None = None) -> dict[str, tuple[str, str]]:
    """``{output: (verdict, reason)}`` per golden made from other weights or inputs than ``now``.

    A checksum ``now`` cannot say (None) is not compared.

    Args:
        goldens: the goldens by output.
        now: today's checksums of the weights and inputs, by what they hash.
        advice: ``advice(what)`` starts the reason with what differs ("the weights built for
            llama-tiny") and ends it with the fix.
        named: the weight tensors that differ, in words ("in 1 of 16 tensors: attn.k.weight"),
            or None where the goldens keep one checksum of all the weights; called for each
            output whose weights differ. Without it the reason quotes the two checksums.
    """
    changed = {}
    for output, golden in goldens.items():
        stored = golden.summary.get("checksums") or {}
        for what, verdict in (("weights", "init changed"), ("inputs", "inputs changed")):
            if now[what] is not None and stored.get(what) != now[what]:
                before, after = str(stored.get(what))[:19], now[what][:19]
                digests = f"{before}... vs {after}..."
                tensors = named() if what == "weights" and named is not None else None
                if tensors:
                    differ = f"differ from the goldens' {tensors}"
                else:
                    if what == "weights" and named is not None:
                        digests += ("; these goldens keep one checksum of all the weights: "
                                    "made anew, they name the tensors that differ")
                    differ = f"differ from those its golden was made from ({digests})"
                changed[output] = (verdict, advice(what).format(differ=differ))
                break
    return changed


#: The verdict of a row whose candidate is within its budget but whose baseline is degraded.
BASELINE_DEGRADED = "baseline degraded"


def judged_fields(comparison: Comparison, cell: Cell) -> dict[str, Any]:
    """What a :class:`CheckResult` takes from a comparison: verdict, headroom, explanation..."""
    worst = comparison.worst
    headroom = math.inf if comparison.shapes else worst.headroom if worst else 0.0
    verdict = comparison.verdict
    # within its budget beside a degraded baseline: a finding about the baseline, not a divergence
    if verdict != "diverged" and comparison.baseline_degraded:
        verdict = BASELINE_DEGRADED
    return {"verdict": verdict, "ok": comparison.ok, "headroom": headroom,
            "explain": comparison.explain(),
            "worst": worst.path if worst else None, "sensitivity": comparison.sensitivity,
            "left_out": comparison.left_out_sentence(),
            "baseline": degraded_baseline(comparison, cell)}


def degraded_baseline(comparison: Comparison, cell: Cell) -> str | None:
    """Which tensors' baseline erred past their dtype (the analytic bound judged them), or None."""
    degraded = [t.path for t in comparison.tensors if t.baseline_degraded]
    if not degraded:
        return None
    which = degraded[0] if len(degraded) == 1 else f"{degraded[0]} and {len(degraded) - 1} more"
    baseline = ("the rerun on weights moved by one float64 rounding" if cell == REFERENCE
                else f"the {cell.dtype} baseline (manual)")
    return (f"{baseline} errs more than a plain {cell.dtype} computation may at {which}: it "
            f"is degraded and sets no budget there; every {cell.dtype} cell is judged by the "
            "analytic bound instead")


def row(feed: Feed, cell: Cell, output: str, verdict: str, *, ok: bool,
        **details: Any) -> CheckResult:
    """One row of ``feed``'s results, ``details`` the other fields of :class:`CheckResult`."""
    return CheckResult(case=feed.name, backend=cell.backend, dtype=cell.dtype,
                       device=cell.device, output=output, kind=feed.kinds[output],
                       verdict=verdict, headroom=details.pop("headroom", None), ok=ok,
                       compile=cell.compile, **details)
