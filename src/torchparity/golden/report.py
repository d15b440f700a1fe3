"""The check's report: the table of verdicts, its footnotes, the failures, the sensitivity and
summary lines, and the JSON."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from torchparity.errors import UsageError
from torchparity.golden.cases import REFERENCE, Cell, CheckResult
from torchparity.golden.compiled import cell_counts, compiled_lines
from torchparity.reference import zoo


def write_json(path: Path, results: list[CheckResult], ok: bool, golden_dir: Path) -> None:
    """``{"ok", "golden_dir", "torch", "results": [row, ...]}``; see :class:`CheckResult`."""
    payload = {"ok": ok, "golden_dir": str(golden_dir), "torch": torch.__version__,
               "results": [r.to_dict() for r in results]}
    try:
        path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write --json {path}: {exc.strerror}") from None


def render(console: Any, results: list[CheckResult], cells: list[Cell],
           cases: list[zoo.ZooCase], elapsed: float) -> None:
    """The table, its footnotes, one line per failure and the summary."""
    from rich.table import Table

    by_cell: dict[tuple[str, Cell], list[CheckResult]] = {}
    for r in results:
        by_cell.setdefault((r.case, r.cell), []).append(r)
    never_run = _never_available(results)
    footnotes: dict[str, int] = {}
    columns = [b for b in dict.fromkeys(c.backend for c in cells if c != REFERENCE)
               if b not in never_run]
    table = Table(title="torchparity check: verdict and share of the tolerance budget used "
                        "(≡ bit-identical to the baseline)", title_justify="left")
    for header in ["case", "reference", *columns]:
        table.add_column(header, no_wrap=True)
    several_devices = len({c.device for c in cells if c != REFERENCE}) > 1
    for case in dict.fromkeys(r.case for r in results):
        row = [case]
        for column in ["reference", *columns]:
            lines = [_cell_text(by_cell[case, cell], footnotes, several_devices)
                     for cell in cells
                     if (cell == REFERENCE) == (column == "reference")
                     and (column == "reference" or cell.backend == column)
                     and (case, cell) in by_cell]
            row.append("\n".join(lines))
        table.add_row(*row)
    print_table(console, table)
    for note, number in footnotes.items():
        console.print(f"[{number}] {note}", markup=False, highlight=False)
    for backend, reason in never_run.items():
        console.print(f"{backend}: n/a in every cell here ({reason})", highlight=False)
    for line in compiled_lines(results):
        console.print(line, markup=False, highlight=False)
    for line in [*_left_out_lines(results), *_baseline_lines(results)]:
        console.print(line, markup=False, highlight=False)
    for r in results:
        if not r.ok:
            console.print(f"FAIL {r.case} {r.cell.label} {r.output}: "
                          f"{r.explain or r.reason}", markup=False, highlight=False)
    console.print(_sensitivity_line(results), markup=False, highlight=False)
    console.print(_summary(results, elapsed), markup=False, highlight=False)


def _left_out_lines(results: list[CheckResult]) -> list[str]:
    """Per case and output, once, which positions its cells left out (padding) and why."""
    lines = (f"{r.case} {r.output}: {r.left_out[0].lower()}{r.left_out[1:]}"
             for r in results if r.left_out)
    return list(dict.fromkeys(lines))


def _baseline_lines(results: list[CheckResult]) -> list[str]:
    """Per case, cell and output, each degraded baseline: a finding about the baseline (which
    then sets no budget), not a divergence of the candidates judged against it."""
    lines = (f"{r.case} {r.output}: {r.baseline}." for r in results if r.baseline)
    return list(dict.fromkeys(lines))


def _sensitivity_line(results: list[CheckResult]) -> str:
    """What the passing cells rule out: per dtype and kind, the largest relative change of an
    output that could have passed (the least sensitive cell's)."""
    weakest: dict[tuple[str, str], float] = {}
    for r in results:
        if r.sensitivity is not None:
            key = (r.dtype, r.kind)
            weakest[key] = max(weakest.get(key, 0.0), r.sensitivity)
    parts = [f"{dtype} {kind} {value:.2g}" for (dtype, kind), value in sorted(weakest.items())]
    return ("Sensitivity (a change of an output by more than this share of its golden's scale"
            " would have been flagged): " + (", ".join(parts) or "none compared"))


def print_table(console: Any, table: Any) -> None:
    """Print a rich table; logs and pipes get all of it rather than an 80-column cut."""
    from rich.measure import Measurement

    if not console.is_terminal:
        wide = console.options.update_width(1000)
        console.width = max(console.width, Measurement.get(console, wide, table).maximum)
    console.print(table)


def _never_available(results: Iterable[CheckResult]) -> dict[str, str]:
    """Backends that are n/a for every output of every cell, with one of their reasons."""
    reasons: dict[str, str | None] = {}
    for r in results:
        if r.backend in reasons and reasons[r.backend] is None:
            continue
        reasons[r.backend] = r.reason if r.verdict == "n/a" else None
    return {b: reason for b, reason in reasons.items() if reason is not None}


def _cell_text(rows: list[CheckResult], footnotes: dict[str, int], with_device: bool) -> str:
    first = rows[0]
    label = f"{first.device} {first.dtype}" if with_device else first.dtype
    if first.compile:
        label += f" {first.compile}"
    failed = [r for r in rows if not r.ok]
    compared = [r for r in rows if r.headroom is not None]
    unavailable = [r for r in rows if r.verdict == "n/a"]
    if failed:
        verdicts = {r.verdict for r in failed}
        worst = max((r.headroom for r in failed if r.headroom is not None), default=None)
        text = "✗ " + "/".join(sorted(verdicts)) + (f" {budget_share(worst)}" if worst else "")
    elif compared:
        identical = all(r.verdict == "identical" for r in compared)
        text = "≡" if identical else f"✓ {budget_share(max(r.headroom for r in compared))}"
    else:
        text = "n/a"
    differing = [f"{r.output}: {s}" for r in rows for s in r.structure or []]
    if differing:
        note = "structure differs (not a divergence): " + "; ".join(differing)
        text += f" [{footnotes.setdefault(note, len(footnotes) + 1)}]"
    if unavailable:
        outputs = ", ".join(r.output for r in unavailable)
        note = f"{outputs} n/a: {unavailable[0].reason}" if compared or failed else \
            f"n/a: {unavailable[0].reason}"
        number = footnotes.setdefault(note, len(footnotes) + 1)
        text += f" [{number}]"
    if first.compiled:
        counts, notes = cell_counts(first.compiled)
        text += f" {counts}" + "".join(f" [{footnotes.setdefault(note, len(footnotes) + 1)}]"
                                       for note in notes)
    return f"{label} {text}"


def budget_share(headroom: float) -> str:
    if headroom == float("inf"):
        return "inf"
    return f"{headroom:.0%}" if headroom < 10 else f"{headroom:.3g}x"


def _summary(results: list[CheckResult], elapsed: float) -> str:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    parts = ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items()))
    status = "OK" if all(r.ok for r in results) else "FAILED"
    cases = len({r.case for r in results})
    return (f"{status}: {len(results)} outputs of {cases} case(s) or model(s) in {elapsed:.1f} s "
            f"({parts})")
