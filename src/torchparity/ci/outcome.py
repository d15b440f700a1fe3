"""What a check or a diagnosis found, in the form CI reports need."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchparity.diagnosis.core.results import (
    Row,
    headroom,
    module_label,
    ratio,
    share_cell,
    unknown_local,
)
from torchparity.diagnosis.pipelines.decoding import DecodeReport
from torchparity.diagnosis.reports.diagnosis import DiagnosisReport
from torchparity.diagnosis.reports.sentence import inherited_from
from torchparity.golden.cells import OWN_FLOAT64, Cell, CheckResult
from torchparity.golden.report import budget_share

#: Flips listed among a decoding's findings (the JUnit report has every one).
FLIPS = 5


@dataclass
class Case:
    """One verdict: a test case of the JUnit report."""

    suite: str
    name: str
    verdict: str
    ok: bool
    message: str = ""
    skipped: str | None = None  # why it could not be judged (an ``n/a`` cell)
    note: str = ""  # a passing case's remark: where the divergence it carries entered
    judged_against: str | None = None  # a check's: the goldens its verdict is against


@dataclass
class Outcome:
    """What ``command`` found on ``subject``: verdict, findings, table and cases."""

    command: str
    subject: str
    ok: bool
    verdict: str
    findings: list[str]
    heads: list[str]
    rows: list[list[str]]
    cases: list[Case] = field(default_factory=list)
    alerts: list[str] = field(default_factory=list)  # the failures worth an annotation each
    seconds: float | None = None  # the command's wall time, when known
    headline: str = ""  # one plain sentence: what changed, where, how much
    next_step: str | None = None  # the exact command to run next (never the one just run)
    legend: str | None = None  # what the table's symbols mean
    full_report: str | None = None  # the HTML page the command wrote


def check_outcome(results: list[CheckResult], subject: str,
                  seconds: float | None = None, next_step: str | None = None) -> Outcome:
    """The outcome of ``torchparity check``: one case per model, cell and output.

    Args:
        results: every output's result, in the table's order.
        subject: what was compared with what, as the summary says it.
        seconds: the command's wall time, shared among the JUnit cases.
        next_step: the command that localises a failure (``diagnose ENTRY --base REV``);
            dropped when everything passed.

    Returns:
        The outcome: the failures' table, else one row per cell.
    """
    failed = [r for r in results if not r.ok]
    cells = {(r.case, r.cell) for r in results}
    if failed:
        verdict = (f"FAIL: {len(failed)} of {len(results)} outputs diverged or changed, in "
                   f"{len({(r.case, r.cell) for r in failed})} of {len(cells)} cells")
        first = failed[0]
        worst = max(failed, key=lambda r: -1.0 if r.headroom is None else r.headroom)
        models = ", ".join(f"`{case}`" for case in dict.fromkeys(r.case for r in failed))
        how_much = ("" if worst.headroom is None else
                    f"; the worst, `{worst.output}` in {worst.cell.label}, used "
                    f"{_of_budget(worst.headroom)}")
        headline = (f"The outputs of {models} changed: {len(failed)} of {len(results)} "
                    f"outputs {_verdict_words(failed)}{how_much}.")
        findings = [f"First failure: `{first.case}` {first.cell.label} `{first.output}`: "
                    f"{first.verdict}" + ("" if first.headroom is None else
                                          f", {_of_budget(first.headroom)}") +
                    " (the JUnit report has the full message)"]
        both = {(r.case, r.cell.label) for r in results if r.stored_goldens}
        if both:
            findings.append(
                f"The model's float64 outputs changed, so {len(both)} cells were judged "
                f"against {OWN_FLOAT64} outputs as well as the stored goldens: "
                + ", ".join(f"`{case}` {label}" for case, label in sorted(both)) + ".")
        heads = ["model", "cell", "output", "verdict", "budget used"]
        rows = [[f"`{r.case}`", r.cell.label, r.output, r.plain_verdict,
                 "-" if r.headroom is None else budget_share(r.headroom)] for r in failed]
    else:
        verdict = (f"PASS: {len(results)} outputs in {len(cells)} cells within their "
                   "budgets or n/a")
        headline = "No output changed beyond the rounding its cell allows."
        next_step = None
        findings = []
        heads = ["model", "cell", "verdict", "most budget used"]
        rows = [_cell_row(case, cell, [r for r in results if (r.case, r.cell) == (case, cell)])
                for case, cell in dict.fromkeys((r.case, r.cell) for r in results)]
    cases = [Case(f"torchparity.check.{r.case}", f"{r.cell.label} {r.output}", r.plain_verdict,
                  r.ok,
                  message="" if r.ok else (r.explain or r.reason or r.verdict)
                  + (f" Against the stored goldens: {r.stored_goldens['verdict']}."
                     if r.stored_goldens else ""),
                  skipped=r.reason if r.verdict == "n/a" else None,
                  judged_against=r.judged_against) for r in results]
    alerts = [f"{case.suite.removeprefix('torchparity.check.')} {case.name}: {case.message}"
              for case in cases if not case.ok]
    return Outcome("torchparity check", subject, not failed, verdict, findings, heads, rows,
                   cases, alerts, seconds, headline, next_step, CHECK_LEGEND)


def diagnosis_outcome(report: DiagnosisReport | DecodeReport, subject: str,
                      seconds: float | None = None, next_step: str | None = None) -> Outcome:
    """The outcome of ``torchparity diagnose``, forward or decoding.

    Args:
        report: the diagnosis.
        subject: what was compared with what, as the summary says it.
        seconds: the command's wall time.
        next_step: the command that writes the full report; dropped when it passed.

    Returns:
        The outcome: the modules that left their budget, else every module.
    """
    if isinstance(report, DecodeReport):
        outcome = _decode_outcome(report, subject)
        outcome.seconds = seconds
        outcome.next_step = None if outcome.ok else next_step
        return outcome
    first, grad = report.first_divergence, report.first_grad_divergence
    ok = report.ok
    if ok:
        verdict = "PASS: no module's local error breaks its budget"
    elif first is not None:
        verdict = f"FAIL: the first divergence is `{first.module or '(model)'}`"
    else:
        verdict = f"FAIL: the first gradient divergence is `{grad.module or '(model)'}`"
    shown = [r for r in report.rows if _diverged(r)] if not ok else report.rows
    rows = [[f"`{r.module or '(model)'}`", r.module_type, share_cell(r.local),
             share_cell(r.propagated)] for r in shown]
    cases = [_module_case(r, report.rows, first) for r in report.rows]
    if ok:
        headline = "No module's own error leaves the rounding its budget allows."
    elif first is not None:
        headline = (f"The model changed in `{module_label(first.module)}` "
                    f"({first.module_type}): its own error is "
                    f"{ratio(headroom(first.local))} times its budget.")
    else:
        headline = (f"The backward pass changed in `{module_label(grad.module)}` "
                    f"({grad.module_type}); its forward output did not leave its budget.")
    return Outcome("torchparity diagnose", subject, ok, verdict, report.findings(),
                   ["module", "type", "local", "propagated"], rows, cases,
                   [] if ok else [report.summary()], seconds, headline,
                   None if ok else next_step, DIAGNOSIS_LEGEND)


def _decode_outcome(report: DecodeReport, subject: str) -> Outcome:
    row = report.first_module
    real = sum(f.verdict == "real change" for f in report.flips)
    if report.ok:
        verdict = "PASS: no step leaves its budget and no token flip is a real change"
        headline = "The generation did not change beyond the rounding its budget allows."
    elif row is not None:
        verdict = f"FAIL: the first module leaving its budget is `{report.first_module_label}`"
        headline = (f"The generation changed from step {report.first_step} on; the first "
                    f"module to leave its budget is `{report.first_module_label}` "
                    f"({row.module_type}).")
    elif report.first_step is not None:
        verdict = f"FAIL: step {report.first_step}'s logits leave their budget"
        headline = f"The generation's logits changed from step {report.first_step} on."
    else:
        verdict = f"FAIL: {real} token flip(s) are real changes"
        headline = f"The generation changed: {real} token flip(s) are real changes."
    findings = report.findings() + [
        f"Sequence {f.sequence} at step {f.step}: A's token {f.a_token}, B's {f.b_token}, "
        f"A's margin {f.margin:.3g}, B's change {f.change:.3g}: {f.verdict}"
        for f in report.flips[:FLIPS]]
    heads = ["module", "type", "inputs", "output"]
    rows = [[f"`{r.module or '(model)'}`", r.module_type, share_cell(r.inputs),
             share_cell(r.propagated)] for r in report.rows
            if r.propagated is not None and not r.propagated.ok]
    suite = "torchparity.diagnose.decode"
    cases = [Case(f"{suite}.steps", f"step {s} logits", r.verdict, r.ok,
                  message="" if r.ok else r.explain()) for s, r in enumerate(report.steps)]
    cases += [Case(f"{suite}.flips", f"sequence {f.sequence} at step {f.step}", f.verdict,
                   f.verdict == "near tie",
                   message=f"A's token {f.a_token}, B's {f.b_token}: margin {f.margin:.3g}, "
                           f"change {f.change:.3g}") for f in report.flips]
    cases += [Case(f"{suite}.modules", f"{r.module or '(model)'} @ step {report.first_step}",
                   "-" if r.propagated is None else r.propagated.verdict, r is not row,
                   message="" if r is not row or r.propagated is None else
                   r.propagated.explain())
              for r in report.rows]
    return Outcome("torchparity diagnose --decode", subject, report.ok, verdict, findings,
                   heads, rows, cases, [] if report.ok else [report.summary()],
                   headline=headline, legend=DECODE_LEGEND)


#: What the check summary's table says.
CHECK_LEGEND = ("budget used: the largest share of its tolerance budget an output used (over "
                "100%: diverged); ≡: bit-identical to the baseline")
#: What the decoding summary's cells say.
DECODE_LEGEND = ("inputs, output: the module's inputs and output at that step, B against the "
                 "golden; =: bit-identical to A; a number: the share of its budget used; X n: "
                 "diverged, using n times its budget; -: not compared")
#: What the diagnosis summary's cells say.
DIAGNOSIS_LEGEND = ("local: B's module fed A's inputs; propagated: B's module in B's own run. "
                    "=: bit-identical to A; a number: the share of its budget used; X n: "
                    "diverged, using n times its budget; <n: within, at most n of it; n/c: "
                    "not compared; -: not computed")


def _of_budget(headroom: float) -> str:
    """``40% of its budget`` or ``6.1e+10 times its budget``."""
    if headroom < 10:
        return f"{headroom:.0%} of its budget"
    return f"{headroom:.2g} times its budget"


def _verdict_words(failed: list[CheckResult]) -> str:
    """``diverged`` or ``diverged or init changed``: the verdicts of the failures."""
    return " or ".join(dict.fromkeys(r.verdict for r in failed))


def _cell_row(case: str, cell: Cell, results: list[CheckResult]) -> list[str]:
    """A passing cell: its verdict and the most budget used (≡ when identical)."""
    compared = [r for r in results if r.verdict != "n/a"]
    if not compared:
        return [f"`{case}`", cell.label, "could not run", "-"]
    identical = all(r.verdict == "identical" for r in compared)
    verdict = ("identical" if identical else "within") + (
        ", could not run in part" if len(compared) < len(results) else "")
    used = max((r.headroom for r in compared if r.headroom is not None), default=None)
    return [f"`{case}`", cell.label, verdict,
            "≡" if identical or used is None else budget_share(used)]


def _module_case(row: Row, rows: list[Row], first: Row | None) -> Case:
    """A module's case: it fails where a divergence enters, and passes with a note where not."""
    # It fails when its own local (or gradient) error breaks its budget and no module inside
    # does; one that only carries a divergence passes, saying where it entered.
    name = module_label(row.module)
    local, propagated, grad = row.local, row.propagated, row.grad_local
    inside = [r for r in rows if r is not row and _contains(row, r)]
    if local is not None and not local.ok:
        changed = next((r for r in inside if r.local is not None and not r.local.ok), None)
        if changed is None:
            return Case("torchparity.diagnose", name, local.verdict, False, local.explain())
        return Case("torchparity.diagnose", name, local.verdict, True,
                    note=f"inherited: its replay diverges ({ratio(headroom(local))} of its "
                         f"budget) because it contains {module_label(changed.module)}, "
                         "whose own local error breaks its budget")
    if grad is not None and not grad.ok and not any(
            r.grad_local is not None and not r.grad_local.ok for r in inside):
        return Case("torchparity.diagnose", name, grad.verdict, False,
                    f"its local gradient error breaks its budget: {grad.explain()}")
    if propagated is not None and not propagated.ok:
        if unknown_local(row):
            return Case("torchparity.diagnose", name, propagated.verdict, True,
                        skipped="its output in B's own run diverged and its own local error "
                                "is unknown: its replay on A's inputs failed")
        own = "not computed" if local is None else local.verdict
        source = (f"; {inherited_from(first.module)}" if first is not None and
                  first is not row else "")
        return Case("torchparity.diagnose", name, propagated.verdict, True,
                    note=f"inherited: its output in B's own run diverged "
                         f"({ratio(headroom(propagated))} of its budget), its own local "
                         f"error is {own}{source}")
    if row.structure:  # told apart from a numeric verdict, as every report does
        return Case("torchparity.diagnose", name, "structure differs", True)
    compared = [r for r in (local, propagated) if r is not None]
    verdicts = {r.verdict for r in compared}
    verdict = next((v for v in ("within", "not compared", "identical") if v in verdicts), "-")
    return Case("torchparity.diagnose", name, verdict, True)


def _contains(parent: Row, row: Row) -> bool:
    """Whether ``row``'s module is inside ``parent``'s (the model contains every one)."""
    return not parent.module or row.module.startswith(f"{parent.module}.")


def _diverged(row: Row) -> bool:
    return any(r is not None and not r.ok for r in (row.local, row.propagated, row.grad_local))

