"""The check's report: the table of verdicts, footnotes, failures, sensitivity, summary, JSON."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchparity import machine, tolerance
from torchparity.errors import UsageError
from torchparity.golden.cells import BOTH_GOLDENS, OWN_FLOAT64, REFERENCE, Cell, CheckResult
from torchparity.golden.compiled_cells import cell_counts, compiled_lines
from torchparity.golden.store import Golden, produced_by
from torchparity.text import WIDTH, wrap

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


@dataclass
class Machines:
    """The machine this check runs on and those that made its goldens (None: unrecorded)."""

    this_run: dict[str, Any]
    goldens: dict[str, dict[str, dict[str, Any] | None]]  # case or model -> output -> it

    @classmethod
    def of(cls, goldens: dict[str, dict[str, Golden]], cells: list[Cell],
           made_here: bool = False) -> Machines:
        """The machines of ``goldens`` and of a run of ``cells`` here."""
        device = "cuda" if any(c.device.startswith("cuda") for c in cells) else "cpu"
        here = produced_by(device)
        return cls(here, {case: {output: here if made_here else golden.summary.get("produced_by")
                                 for output, golden in outputs.items()}
                          for case, outputs in goldens.items()})

    def made_on(self, case: str) -> str | None:
        """The machine that made ``case``'s goldens, or None for this one (or unrecorded)."""
        labels = dict.fromkeys(machine.label(p) for p in self.goldens.get(case, {}).values())
        here = machine.label(self.this_run)
        return None if list(labels) in ([], [here]) else " and ".join(labels)

    def header(self) -> str | None:
        """One line naming both machines where a golden was made on another (its cases), or None."""
        cases_by_machine: dict[str, list[str]] = {}
        for case in self.goldens:
            if (made_on := self.made_on(case)) is not None:
                cases_by_machine.setdefault(made_on, []).append(case)
        if not cases_by_machine:
            return None
        if len(cases_by_machine) == 1 and len(*cases_by_machine.values()) == len(self.goldens):
            made = next(iter(cases_by_machine))
        else:
            made = "; ".join(f"{label} ({', '.join(cases)})"
                             for label, cases in cases_by_machine.items())
        return f"goldens made on {made}; this run on {machine.label(self.this_run)}"

    def context(self, case: str) -> str | None:
        """What a failure of ``case`` adds when its goldens come from another machine, or None."""
        made_on = self.made_on(case)
        return None if made_on is None else (
            f"goldens made on {made_on}, this run on {machine.label(self.this_run)}")

    def to_dict(self) -> dict[str, object]:
        """The machines as ``check --json`` writes them: ``{"this_run", "goldens"}``."""
        return {"this_run": self.this_run, "goldens": self.goldens}


def write_json(path: Path, results: list[CheckResult], ok: bool, golden_dir: Path,
               machines: Machines) -> None:
    """Write the results as JSON: ``{"ok", "golden_dir", "torch", "machines", "results"}``."""
    payload = {"ok": ok, "golden_dir": str(golden_dir), "torch": torch.__version__,
               "machines": machines.to_dict(), "results": [r.to_dict() for r in results]}
    try:
        path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write --json {path}: {exc.strerror}") from None


@dataclass
class Page:
    """What the check's report says, in order, for terminal and HTML alike: lines, table, lines."""

    before: list[str]
    headers: list[str]
    rows: list[list[str]]  # a row per case, a column per backend, a line per dtype in a cell
    after: list[str]


def check_page(results: list[CheckResult], cells: list[Cell], elapsed: float,
         machines: Machines) -> Page:
    """The check's report: machines if the goldens' differ, table, footnotes, failures, summary."""
    before = reference_lines(results)  # a change of the model itself, said first
    if (header := machines.header()) is not None:
        before.append(header)
    by_cell: dict[tuple[str, Cell], list[CheckResult]] = {}
    for r in results:
        by_cell.setdefault((r.case, r.cell), []).append(r)
    never_run = _never_available(results)
    footnotes: dict[str, int] = {}
    columns = [b for b in dict.fromkeys(c.backend for c in cells if c != REFERENCE)
               if b not in never_run]
    several_devices = len({c.device for c in cells if c != REFERENCE}) > 1
    rows = []
    for case in dict.fromkeys(r.case for r in results):
        row = [case]
        for column in ["reference", *columns]:
            lines = [_cell_text(by_cell[case, cell], footnotes, several_devices)
                     for cell in cells
                     if (cell == REFERENCE) == (column == "reference")
                     and (column == "reference" or cell.backend == column)
                     and (case, cell) in by_cell]
            row.append("\n".join(lines))
        rows.append(row)
    after = [f"[{number}] {note}" for note, number in footnotes.items()]
    after += [f"{backend}: n/a in every cell here ({reason})"
              for backend, reason in never_run.items()]
    after += [*compiled_lines(results), *_left_out_lines(results), *_renamed_lines(results),
              *_baseline_lines(results), *stored_goldens_lines(results)]
    changed: dict[tuple[str, str | None], int] = {}  # the weights or inputs, said once
    for r in results:
        if not r.ok and r.verdict in _CHANGED:
            changed[r.case, r.reason] = changed.get((r.case, r.reason), 0) + 1
        elif not r.ok:
            context = machines.context(r.case)
            against = f" (against {OWN_FLOAT64})" if r.stored_goldens else ""
            after.append(f"FAIL {r.case} {r.cell.label} {r.output}{against}: "
                         f"{r.explain or r.reason}" + (f" ({context})" if context else ""))
    for (case, reason), count in changed.items():
        context = machines.context(case)
        after.append(f"FAIL {case} ({count} row(s), every cell): {reason}"
                     + (f" ({context})" if context else ""))
    after += [*sensitivity_lines(results), _summary(results, elapsed)]
    return Page(before, ["case", "reference", *columns], rows, after)


#: Verdicts of goldens made from other weights or inputs: one reason for every row of a case.
_CHANGED = ("init changed", "inputs changed")


def render(console: Console, content: Page) -> None:
    """``content`` on ``console``: its lines wrapped, its table folded to the width."""
    # Logs and pipes have no width: every line fits 80 columns there, wrapped at spaces and
    # never cut; the table is folded into as many tables as it takes.
    width = console.width if console.is_terminal else TABLE_WIDTH

    def say(text: str) -> None:
        for line in wrap(text, width):
            console.print(line, markup=False, highlight=False, soft_wrap=True)

    for line in [*content.before, TITLE, LEGEND]:
        say(line)
    for table in folded_tables(None, content.headers, content.rows, width):
        print_table(console, table, width)
    for line in content.after:
        say(line)


#: The check's title line.
TITLE = "torchparity check: each cell's verdict and the most of its budget used"
#: What the symbols of the check's table mean.
SYMBOLS = (("≡", "bit-identical to the baseline"), ("✓", "within its budget"),
           ("✗", "diverged"), ("n/a", "could not run here"), ("[n]", "a note below the table"))
LEGEND = ", ".join(f"{symbol} {meaning}" for symbol, meaning in SYMBOLS)
#: A sensitivity at or above this share of the golden's scale rules out nothing: a change as
#: large as the output itself would have passed.
COARSE = 1.0
#: What a cell with such a sensitivity is marked with.
COARSE_NOTE = ("coarse: an output of this cell would only have flagged a change larger "
               "than its golden's own scale (see Sensitivity below)")


def reference_lines(results: list[CheckResult]) -> list[str]:
    """First, per case whose reference cell failed, a line: the model itself changed."""
    # its own float64 no longer matches its goldens: the other cells are judged against goldens of
    # another model
    failed: dict[str, list[str]] = {}
    for r in results:
        if r.cell == REFERENCE and not r.ok and r.verdict not in _CHANGED:
            failed.setdefault(r.case, []).append(f"{r.output} {r.verdict}")
    both = {r.case for r in results if r.judged_against == BOTH_GOLDENS}
    return [f"The model's outputs changed: {case}'s {REFERENCE.label} cell (the manual "
            f"backend in float64) no longer matches its goldens ({', '.join(outputs)}). That "
            "is a change of the model's math, not of a backend or dtype. "
            + (f"The other cells are judged against {OWN_FLOAT64} outputs, so a backend or "
               "dtype problem still shows; their verdicts against the stored goldens follow "
               "the table." if case in both else
               "The other cells are judged against the stored goldens as usual: none of "
               "the outputs they judge diverged in float64.")
            for case, outputs in failed.items()]


#: The note of a cell judged against this revision's own float64 as well.
BOTH_NOTE = (f"judged against {OWN_FLOAT64} outputs (the model changed) and against the "
             "stored goldens (see below)")


def stored_goldens_lines(results: list[CheckResult]) -> list[str]:
    """The rows judged against this revision's own float64 as well, per case, dtype and output."""
    # their verdicts against the stored goldens and, where the budget grew past what the cells
    # allow against their own model, by how much and why
    groups: dict[tuple[str, str, str], list[CheckResult]] = {}
    for r in results:
        if r.stored_goldens:
            groups.setdefault((r.case, r.dtype, r.output), []).append(r)
    if not groups:
        return []
    lines = [f"Against the stored goldens (of the model before its change; the verdicts "
             f"above are against {OWN_FLOAT64}):"]
    for (case, dtype, output), rows in groups.items():
        stored = [r.stored_goldens for r in rows]
        verdicts = "/".join(sorted({s["verdict"] for s in stored}))
        shares = [s["headroom"] for s in stored if s["headroom"] is not None]
        line = f"{case} {dtype} {output}: {verdicts} in {len(rows)} cell(s)" + (
            f", at most {budget_share(max(shares))}" if shares else "")
        grown = [(r.stored_goldens["sensitivity"], r.sensitivity) for r in rows
                 if r.stored_goldens["sensitivity"] is not None and r.sensitivity
                 and r.stored_goldens["sensitivity"] > tolerance.BUDGET_GROWTH * r.sensitivity]
        if grown:
            wide, usual = max(grown, key=lambda pair: pair[0] / pair[1])
            line += (f"; budget {wide / usual:.2g} times what the cell allows against its own "
                     f"model (sensitivity {wide:.2g}, not {usual:.2g}): the {dtype} baseline "
                     "carries the model's change")
        lines.append(line)
    return lines + _stored_only_lines(results, {case for case, _, _ in groups})


def _stored_only_lines(results: list[CheckResult], changed: set[str]) -> list[str]:
    """A changed model's rows judged against stored goldens only: baselines carry the change."""
    widest: dict[tuple[str, str, str], float] = {}
    for r in results:
        if (r.case in changed and r.cell != REFERENCE and not r.stored_goldens
                and r.sensitivity is not None):
            key = (r.case, r.dtype, r.output)
            widest[key] = max(widest.get(key, 0.0), r.sensitivity)
    return [f"{case} {dtype} {output}: against the stored goldens only (it follows their "
            f"tokens), with a budget earned by a baseline that carries the model's change "
            f"(sensitivity {value:.2g})"
            for (case, dtype, output), value in widest.items()]


def _left_out_lines(results: list[CheckResult]) -> list[str]:
    """Which positions the cells left out and why: a line per output and reason, its cases."""
    prefix = "Left out of the judgement: "
    cases: dict[tuple[str, str], list[str]] = {}
    for r in results:
        if r.left_out:
            note = r.left_out.removeprefix(prefix)
            names = cases.setdefault((r.output, note), [])
            if r.case not in names:
                names.append(r.case)
    if not cases:
        return []
    return ["Padded positions left out of the judgement (what two backends write there is "
            "arbitrary):", *(f"{', '.join(names)} {output}: {note}"
                            for (output, note), names in cases.items())]


def _renamed_lines(results: list[CheckResult]) -> list[str]:
    """Per model, the modules its goldens name otherwise, through which its weights were judged."""
    lines = list(dict.fromkeys(f"{r.case}: {r.renamed}" for r in results if r.renamed))
    if not lines:
        return []
    return ["Weights and gradients judged by meaning, part by part where one side fuses "
            "what the other keeps apart (model <- goldens):", *lines]


def _baseline_lines(results: list[CheckResult]) -> list[str]:
    """Each degraded baseline: a finding about it (it sets no budget), not a divergence."""
    lines = (f"{r.case} {r.output}: {r.baseline}." for r in results if r.baseline)
    return list(dict.fromkeys(lines))


def sensitivity_lines(results: list[CheckResult]) -> list[str]:
    """What the passing cells rule out, per dtype and kind: the largest change that could pass."""
    weakest: dict[tuple[str, str], float] = {}
    for r in results:
        if r.sensitivity is not None:
            key = (r.dtype, r.kind)
            weakest[key] = max(weakest.get(key, 0.0), r.sensitivity)
    parts = [f"{dtype} {kind} {value:.2g}" + (" (coarse)" if value >= COARSE else "")
             for (dtype, kind), value in sorted(weakest.items())]
    lines = ["Sensitivity: a change of an output larger than this share of its golden's "
             "scale would have been flagged (the least sensitive cell per dtype and kind): "
             + (", ".join(parts) or "none compared") + "."]
    if any(value >= COARSE for value in weakest.values()):
        lines.append("coarse: 1 or more means that even a change as large as the output "
                     "itself could have passed; such a verdict rules out little (the cells "
                     "are marked)")
    return lines


#: The width of the check's table where the output has none (a log, a pipe).
TABLE_WIDTH = WIDTH
#: The narrowest a folded case column gets before a table grows past its width instead.
CASE_MIN_WIDTH = 16


def folded_tables(title: str | None, headers: list[str], rows: list[list[str]], width: int
                  ) -> list[Table]:
    """The table as rich tables of at most ``width`` columns, no column cut, the first titled."""
    from rich.cells import cell_len
    from rich.table import Table

    # A column takes its widest line and 3 more (padding and a rule); a table 1 more.
    # each keeps the case column and takes as many next ones as fit; a long case name folds, and a
    # table passes width only where even that cannot fit
    widths = [max(cell_len(line) for text in [header, *(row[column] for row in rows)]
                  for line in text.split("\n")) + 3
              for column, header in enumerate(headers)]

    def table(columns: list[int], titled: bool) -> Table:
        others = 1 + sum(widths[column] for column in columns)
        made = Table(title=title if titled else None, title_justify="default",
                     width=None if others + widths[0] <= width
                     else max(width, others + CASE_MIN_WIDTH + 3))
        made.add_column(headers[0], overflow="fold")
        for column in columns:
            made.add_column(headers[column], no_wrap=True)
        for row in rows:
            made.add_row(row[0], *(row[column] for column in columns))
        return made

    groups: list[list[int]] = [[]]
    for column in range(1, len(headers)):
        if groups[-1] and 1 + widths[0] + sum(widths[c] for c in [*groups[-1], column]) > width:
            groups.append([])
        groups[-1].append(column)
    return [table(group, titled=number == 0) for number, group in enumerate(groups)]


def print_table(console: Console, table: Table, width: int | None = None) -> None:
    """Print a rich table whole (logs and pipes too), in ``width`` columns unless it sets one."""
    from rich.measure import Measurement

    if not console.is_terminal:
        wide = Measurement.get(console, console.options.update_width(1000), table).maximum
        console.width = max(console.width, table.width or width or wide)
    console.print(table, width=table.width or width, soft_wrap=False if width else None)


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
    if any(r.judged_against == BOTH_GOLDENS for r in rows):
        text += f" [{footnotes.setdefault(BOTH_NOTE, len(footnotes) + 1)}]"
    if any(r.sensitivity is not None and r.sensitivity >= COARSE for r in rows):
        text += f" [{footnotes.setdefault(COARSE_NOTE, len(footnotes) + 1)}]"
    if first.compiled:
        counts, notes = cell_counts(first.compiled)
        text += f" {counts}" + "".join(f" [{footnotes.setdefault(note, len(footnotes) + 1)}]"
                                       for note in notes)
    return f"{label} {text}"


def budget_share(headroom: float) -> str:
    """A headroom (error over budget) as shown: ``37%`` to 10 budgets, then ``12.5x``, ``inf``."""
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
