"""The divergence report and the attribution report, on the terminal and in JSON."""

from __future__ import annotations

import io
import json
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchparity.comparison.tensor import json_safe
from torchparity.diagnosis.core.reference import golden_warning
from torchparity.diagnosis.core.results import (
    NotCompared,
    Result,
    Row,
    diverged,
    headroom,
    module_label,
    ratio,
    shape_difference,
    share_cell,
    structure_difference,
    unknown_local,
)
from torchparity.diagnosis.reports.columns import Line, layout, print_lines
from torchparity.diagnosis.reports.folding import FOLD_ABOVE, Fold, folded
from torchparity.diagnosis.reports.html import diagnosis_html_page, layer_groups
from torchparity.diagnosis.reports.meta import AttributionMeta, DiagnosisMeta
from torchparity.diagnosis.reports.sentence import (
    backward_sentence,
    entered_at,
    entry_note,
    forward_clause,
)
from torchparity.text import print_trimmed

__all__ = ["AttributionReport", "DiagnosisReport", "Report", "Unit"]


class Report:
    """JSON and plain text of a report, from its own ``to_dict()`` and ``print(console)``."""

    @property
    def exit_status(self) -> int:
        """0 when the diagnosis passes (``ok``), 1 when it does not."""
        return 0 if self.ok else 1

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The report as JSON text; also written to ``path`` when given."""
        text = json.dumps(self.to_dict(), indent=1)
        if path is not None:
            Path(path).write_text(text)
        return text

    def show(self, console: Any, json_path: str | None = None, html_path: str | None = None
             ) -> None:
        """Print the report to ``console`` and write its JSON and HTML where asked."""
        warning = golden_warning(getattr(self.meta, "golden", ""))  # "": no golden used
        if warning:
            print_trimmed(console, warning)
        self.print(console)
        if json_path:
            self.to_json(json_path)
        if html_path:
            self.to_html(html_path)

    def render(self, width: int = 100) -> str:
        """The report as plain text, ``width`` columns wide."""
        from rich.console import Console

        buffer = io.StringIO()
        self.print(Console(file=buffer, width=width, force_terminal=False, color_system=None))
        return buffer.getvalue()


@dataclass
class DiagnosisReport(Report):
    """Result of :func:`torchparity.diagnose` and :func:`torchparity.diagnose_against`."""

    rows: list[Row]  # in the order their forward finished in B: children before their parent
    output: Result | None
    loss: Result | None
    unmatched_a: list[str]  # calls that could not be aligned
    unmatched_b: list[str]
    meta: DiagnosisMeta

    @property
    def first_divergence(self) -> Row | None:
        """The first row whose local error breaks its budget; None when none does."""
        return next((r for r in self.rows if r.local is not None and not r.local.ok), None)

    @property
    def first_grad_divergence(self) -> Row | None:
        """The first row in backward order whose local gradient error breaks its budget."""
        # Backward runs in reverse start order: later modules, and children before parents.
        broken = [r for r in self.rows if r.grad_local is not None and not r.grad_local.ok]
        return max(broken, key=lambda r: r.start, default=None)

    @property
    def ok(self) -> bool:
        """True when no module's local error, forward or backward, breaks its budget."""
        return self.first_divergence is None and self.first_grad_divergence is None

    def row(self, module: str) -> Row:
        """The row of B's module ``module``; KeyError naming close names otherwise."""
        for r in self.rows:
            if r.module == module:
                return r
        names = ", ".join(r.module for r in self.rows)
        raise KeyError(f"no row for module {module!r}; rows: {names}")

    @property
    def structure_only(self) -> list[Row]:
        """Rows whose outputs differ from A's in structure and in nothing else."""
        return [r for r in self.rows if r.structure and not diverged(r)]

    def summary(self) -> str:
        """A few sentences: where A and B part and where that enters, the verdict, the mode."""
        return " ".join(self.findings())

    def findings(self, ops: bool = True) -> list[str]:
        """The sentences of :meth:`summary`; without ``ops``, those of the op drill-downs."""
        parts = []
        first = self.first_divergence
        if first is None:
            parts.append("No module's local error breaks its budget.")
        else:
            what = (shape_difference(first.shapes[0]) if first.shapes else
                    f"local error {ratio(headroom(first.local))} of budget")
            parts.append(f"First divergence: {module_label(first.module)} ({first.module_type}), "
                         f"{what}.")
            found = first.ops is not None and first.ops.answer is not None
            if first.entry is not None and not found:
                parts.append(entered_at(first.entry))
            if first.ops is not None and ops:
                parts.append(first.ops.sentence(first.entry))
        if self.meta.backward:
            grad = self.first_grad_divergence
            follows = None if grad is None or grad.grad_ops is None else grad.grad_ops.follows
            parts.append("No gradient diverges locally." if grad is None else
                         f"First gradient divergence: {module_label(grad.module)}" +
                         ("." if follows is None else
                          f", which follows from {forward_clause(follows.module)}."))
            if grad is not None and grad.grad_ops is not None and ops:
                parts.append(backward_sentence(grad.grad_ops.sentence()))
        structural = self.structure_only
        if structural:
            where = structural[0]
            parts.append(f"{len(structural)} module(s) differ in structure only, no numeric "
                         f"divergence (first: {module_label(where.module)} "
                         f"{where.structure[0].path}).")
        if self.output is not None:
            shape = getattr(self.output, "structure", ())
            paths = f" (structure differs at {', '.join(d.path for d in shape)})" if shape else ""
            parts.append(f"Final output: {self.output.verdict}{paths}.")
        if self.meta.below_noise:
            parts.append(f"But {self.meta.below_noise}.")
        if (unknown := self._unknown_sentence()) is not None:
            parts.append(unknown)
        parts.append(self._verdict_sentence())
        if self.meta.mode:
            parts.append(f"Mode: {self.meta.mode}.")
        return parts

    def _unknown_sentence(self) -> str | None:
        """The modules whose local error is unknown, and whether the verdict could hang on them."""
        unknown = [r for r in self.rows if unknown_local(r)]
        if not unknown:
            return None
        names = ", ".join(module_label(r.module) for r in unknown[:3])
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        first = self.first_divergence
        if first is not None and first.start < min(r.start for r in unknown):
            depends = (f"the verdict does not depend on them: {module_label(first.module)} "
                       "diverges before them")
        else:
            depends = ("the verdict could depend on them: a change inside them would be "
                       "missed or placed elsewhere")
        return (f"The local error of {len(unknown)} module(s) is unknown, their replay on "
                f"A's inputs failed ({names}{more}); {depends}.")

    def _verdict_sentence(self) -> str:
        """Why the diagnosis passes or fails, whatever the final output says."""
        first, grad = self.first_divergence, self.first_grad_divergence
        if first is None and grad is None:
            return "Verdict: pass, no module's local error breaks its budget."
        why = []
        if first is not None:
            why.append(f"the local error of {module_label(first.module)} breaks its budget")
        if grad is not None:
            why.append(f"the local gradient error of {module_label(grad.module)} breaks its "
                       "budget")
        tail = ""
        if self.output is not None and self.output.ok:
            tail = (", although the final output stays within its budget: the change is "
                    "real but smaller than the output's noise" if first is not None else
                    ", although the output stays within its budget: the backward pass "
                    "differs, the forward pass does not")
        return f"Verdict: fail (exit 1): {' and '.join(why)}{tail}."

    # -- JSON ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        first, grad = self.first_divergence, self.first_grad_divergence
        return json_safe({
            "summary": self.summary(),
            "first_divergence": _divergence(first, "ops"),
            "first_grad_divergence": _divergence(grad, "grad_ops"),
            "output": self.output.to_dict() if self.output else None,
            "loss": self.loss.to_dict() if self.loss else None,
            "rows": [r.to_dict() for r in self.rows],
            "unmatched_a": self.unmatched_a,
            "unmatched_b": self.unmatched_b,
            "meta": self.meta.to_json(),
        })

    # -- terminal -----------------------------------------------------------------------------

    def render(self, width: int = 120) -> str:
        """The report as plain text: the table, unmatched modules and notes."""
        return super().render(width)

    def print(self, console: Any = None, *, fold: bool = True) -> None:
        """Print the summary, the rows and the notes to ``console`` (default: stdout)."""
        from rich.console import Console

        console = console or Console()
        lines = self._lines(fold)
        print_trimmed(console, " ".join(self.findings(ops=False)))
        print_lines(console, self.table_lines(console.width, fold=fold))
        shown = {line for line in lines if isinstance(line, int)}
        for line in self._footer(shown if len(shown) < len(self.rows) else None):
            print_trimmed(console, line)

    def table_lines(self, width: int, *, fold: bool = True) -> list[tuple[str, str | None]]:
        """The rows as text lines of ``width`` columns, each with its rich style."""
        # The module name is the last column and never cut: in an 80-column CI log it is the
        # answer. With ``fold``, a long report keeps the rows that matter (see :meth:`_lines`).
        backward = self.meta.backward
        heads = ["#", "local", "prop."] + (["grad l.", "grad p."] if backward else [])
        first, grad = self.first_divergence, self.first_grad_divergence
        rows = []
        for line in self._lines(fold):
            if isinstance(line, Fold):
                rows.append(self._fold_line(line, backward))
                continue
            r = self.rows[line]
            cells = [str(line), share_cell(r.local), share_cell(r.propagated)]
            if backward:
                cells += [share_cell(r.grad_local), share_cell(r.grad_propagated)]
            name = module_label(r.module) + _aligned_as(r)
            if r.structure:
                name += " (structure differs)"
            style = "bold red" if r is first or r is grad else (
                "dim" if r.local is not None and r.local.verdict == "identical" else None)
            rows.append(Line(cells, name, r.depth, style, _ops_lines(r, width)))
        return layout([*heads, "module (B)"], rows, width)

    def _lines(self, fold: bool) -> list[int | Fold]:
        """The table's lines: row indices and folds (see :meth:`table_lines`)."""
        if not fold or len(self.rows) <= FOLD_ABOVE:
            return list(range(len(self.rows)))
        important = {i for i, r in enumerate(self.rows)
                     if r is self.first_divergence or r is self.first_grad_divergence
                     or r.entry is not None or r.structure
                     or any(x is not None and not x.ok for x in (r.local, r.grad_local))}
        return folded(layer_groups(self.rows), important,
                      lambda group: tuple(_worst_class(self._column(group, attr))
                                          for attr in _COLUMNS))

    def _column(self, indices: Any, attr: str) -> list[Result | None]:
        return [getattr(self.rows[i], attr) for i in indices]

    def _fold_line(self, line: Fold, backward: bool) -> Line:
        """The cells of a fold: its rows, the worst cell of each column, and what it folds."""
        rows = [self.rows[i] for i in line.rows]
        cells = ["…"]
        cells += [share_cell(_worst(self._column(line.rows, attr)))
                  for attr in _COLUMNS[:4 if backward else 2]]
        span = f"rows {line.rows[0]}-{line.rows[-1]}"
        if len(line.ends) == 1:
            what = f"{span}, {module_label(self.rows[line.ends[0]].module)}"
        elif line.ends:
            what = (f"{span}, {module_label(self.rows[line.ends[0]].module)} to "
                    f"{module_label(self.rows[line.ends[-1]].module)}")
        else:
            what = f"{span} of {module_label(self.rows[line.owner].module)}"
        return Line(cells, f"({what})", rows[0].depth, "dim")

    def _footer(self, shown: set[int] | None = None) -> list[str]:
        lines = ["cells: share of the budget used (=: bit-identical to A, X: diverged, -: not "
                 f"computed{not_compared_legend(self.rows)}); prop.: in B's own run, local: B's "
                 "module on A's inputs"]
        if shown is not None:
            lines.append(f"…: {len(self.rows) - len(shown)} of {len(self.rows)} rows folded "
                         "into lines with the worst cell of each column; --json and --html "
                         "have every row")
        if self.unmatched_a:
            lines.append(f"unmatched in A: {', '.join(self.unmatched_a)}")
        if self.unmatched_b:
            lines.append(f"unmatched in B: {', '.join(self.unmatched_b)}")
        lines += [f"note: {note}" for note in self.meta.notes]
        for index, r in enumerate(self.rows):
            if shown is not None and index not in shown:
                continue
            if r.entry is not None and (r.ops is None or r.ops.answer is None):
                lines.append(entry_note(r.module, r.entry))
            lines += [f"{module_label(r.module)}: {shape_difference(d)}" for d in r.shapes]
            lines += [f"{module_label(r.module)}: structure differs at {structure_difference(d)}"
                      for d in r.structure]
            lines += [f"{module_label(r.module)}: {note}" for note in r.notes]
        shape = getattr(self.output, "structure", ())
        lines += [f"final output: structure differs at {structure_difference(d)}" for d in shape]
        return lines

    def __str__(self) -> str:
        return self.render()

    # -- HTML ---------------------------------------------------------------------------------

    def to_html(self, path: str | os.PathLike | None = None) -> str:
        """A self-contained HTML page; written to ``path`` if given."""
        page = diagnosis_html_page(self)
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page


@dataclass
class Unit:
    """One change of B (a module or the attention backend) and the output error it explains."""

    # mean squared differences from A's output: ``swap_in`` of A with only this unit from B,
    # ``leave_out`` of B with only this unit from A, ``total`` of B itself

    name: str
    kind: str
    total: float
    swap_in: float
    leave_out: float

    @property
    def share(self) -> float | None:
        """Share of B's error this unit causes on its own (swap in); None when A and B agree."""
        return self.swap_in / self.total if self.total > 0 else None

    @property
    def leave_out_share(self) -> float | None:
        """Share of B's error that disappears without this unit (leave out)."""
        return 1.0 - self.leave_out / self.total if self.total > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return json_safe({"name": self.name, "kind": self.kind, "swap_in_error": self.swap_in,
                           "leave_out_error": self.leave_out, "share": self.share,
                           "leave_out_share": self.leave_out_share})


@dataclass
class AttributionReport(Report):
    """Result of :func:`torchparity.attribute`: units of change and their shares of the error."""

    units: list[Unit]
    total: float
    skipped: dict[str, str]
    meta: AttributionMeta

    def unit(self, name: str) -> Unit:
        """The unit called ``name`` (a module of B, or "backend ..."); KeyError otherwise."""
        for unit in self.units:
            if unit.name == name or (name == "backend" and unit.kind == "backend"):
                return unit
        raise KeyError(f"no unit {name!r}; units: {', '.join(u.name for u in self.units)}")

    def summary(self) -> str:
        if self.total == 0:
            return "A and B give identical outputs: nothing to attribute."
        if not self.units:
            return "No unit of change found: B differs only where modules cannot be swapped."
        top = max(self.units, key=lambda u: u.swap_in)
        return (f"{top.name} explains {_percent(top.share)} of the output error on its own; "
                f"leaving it out removes {_percent(top.leave_out_share)}.")

    def to_dict(self) -> dict[str, Any]:
        return json_safe({"summary": self.summary(), "total_error": self.total,
                           "units": [u.to_dict() for u in self.units],
                           "skipped": self.skipped, "meta": self.meta.to_json()})

    def print(self, console: Any = None) -> None:
        from rich.console import Console
        from rich.table import Table

        console = console or Console()
        table = Table(title=self.summary(), title_justify="left")
        for column in ("unit", "kind", "share (swap in)", "share (leave out)"):
            table.add_column(column)
        for unit in sorted(self.units, key=lambda u: -u.swap_in):
            table.add_row(unit.name, unit.kind, _percent(unit.share),
                          _percent(unit.leave_out_share))
        print_trimmed(console, table)
        for name, reason in self.skipped.items():
            print_trimmed(console, f"not attributed: {name}: {reason}")

    def __str__(self) -> str:
        return self.render()


_COLUMNS = ("local", "propagated", "grad_local", "grad_propagated")


def _worst(results: list[Result | None]) -> Result | None:
    """The result of the largest share of its budget (a diverged one first)."""
    present = [r for r in results if r is not None]
    return max(present, key=lambda r: (not r.ok, headroom(r) or 0.0), default=None)


def _worst_class(results: list[Result | None]) -> str:
    worst = _worst(results)
    if worst is None:
        return "-"
    if worst.ok and all(r is None or r.verdict == "identical" for r in results):
        return "identical"
    return "within" if worst.ok else "diverged"


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.1f}%"


# --------------------------------------------------------------------------------------------
# cells


def _aligned_as(row: Row) -> str:
    return "" if row.how == "name" else f" <- {row.a_module or '(model)'} [{row.how}]"


def not_compared_legend(rows: list[Row]) -> str:
    """What ``n/c`` means, for a legend, when a row shows it."""
    shown = any(isinstance(getattr(r, attr), NotCompared) for r in rows
                for attr in (*_COLUMNS, "inputs"))
    return ", n/c: not compared, nothing alike on both sides" if shown else ""


def _divergence(row: Row | None, ops: str) -> dict[str, Any] | None:
    """``first_divergence`` (or the gradient's) in the JSON: B's module and its op if drilled."""
    if row is None:
        return None
    drilled = getattr(row, ops)
    return {"module": row.module, "op": drilled.to_dict() if drilled else None}


def _ops_lines(row: Row, width: int) -> tuple[tuple[str, str | None], ...]:
    """A drilled row's op tables, forward and backward, each closed by its sentence."""
    lines = []
    for ops, backward in ((row.ops, False), (row.grad_ops, True)):
        if ops is not None:
            said = backward_sentence(ops.sentence()) if backward else ops.sentence(row.entry)
            lines += ops.table_lines(width)
            lines += [(f" {text}", "bold") for text in textwrap.wrap(
                said, width - 1, break_long_words=False, break_on_hyphens=False)]
            lines += [(f" {text}", None) for text in textwrap.wrap(
                ops.built_sentence(), width - 1, break_long_words=False,
                break_on_hyphens=False)]
    return tuple(lines)
