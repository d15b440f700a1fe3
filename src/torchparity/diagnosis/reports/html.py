"""The HTML page of a divergence report, and the cells and plots other pages share."""

from __future__ import annotations

import html
import math
from typing import Any

from torchparity.comparison.tensor import json_safe
from torchparity.diagnosis.core.results import (
    Result,
    Row,
    diverged,
    headroom,
    module_label,
    ratio,
    shape_difference,
    share_cell,
    structure_difference,
)
from torchparity.diagnosis.reports.sentence import entry_mark
from torchparity.pages import legend_paragraph, page


def settings_details(meta: dict[str, Any]) -> str:
    """The run's settings, folded away under the page."""
    return f"<details><summary>settings</summary>{settings_table(meta)}</details>"


# The report is untyped here: its class, DiagnosisReport, lives in a module that imports this one.
def diagnosis_html_page(report: Any) -> str:
    """The page of a divergence report: its summary, plots, rows, op tables and settings."""
    plots = [svg_plot(report.rows, {"local": "local", "propagated": "propagated"},
                      "Forward error / budget")]
    if report.meta.backward:
        plots.append(svg_plot(report.rows, {"local": "grad_local",
                                            "propagated": "grad_propagated"},
                              "Gradient error / budget"))
    unmatched = "".join(
        f"<p class='note'>Unmatched in {side}: {html.escape(', '.join(names))}</p>"
        for side, names in (("A", report.unmatched_a), ("B", report.unmatched_b)) if names)
    notes = "".join(f"<p class='note'>{html.escape(n)}</p>" for n in report.meta.notes)
    return page("torchparity diagnosis",
                f"<p class='summary'>{html.escape(report.summary())}</p>"
                + "".join(plots) + _html_table(report) + legend(report)
                + "".join(ops.to_html(r.entry if ops is r.ops else None) for r in report.rows
                          for ops in (r.ops, r.grad_ops) if ops is not None)
                + unmatched + notes
                + settings_details(report.meta.to_json()))


#: What each symbol of a cell means, in the words of the terminal's legend.
CELL_LEGEND = (("=", "bit-identical to A"),
               ("0.15", "within its budget, using that share of it"),
               ("<.18", "within its budget, using at most that share of it (a bound)"),
               ("X 46", "diverged: the error is that many times its budget"),
               ("X shape", "A and B hold tensors of different shapes there"),
               ("n/c", "not compared: A and B hold nothing alike there"),
               ("-", "not computed"))
#: What each column holds.
COLUMN_LEGEND = (("local", "B's module fed A's recorded inputs, against the golden fed the same"),
                 ("propagated", "B's module in B's own run, against the golden's run"),
                 ("amplification", "propagated error / local error: about 1 where the module "
                                   "is the source, large where it carries error from upstream"),
                 ("A", "A's module, where it is not aligned by name"),
                 ("grad local", "the gradients of B's module's inputs and own parameters, "
                                "fed A's output gradient"),
                 ("grad propagated", "the gradients of its outputs and own parameters in B's "
                                     "own backward pass"))


def legend(report: Any) -> str:
    """The symbols of the cells and the columns the table shows, each explained."""
    shown = set(_columns(report))
    return legend_paragraph(CELL_LEGEND,
                            [(name, text) for name, text in COLUMN_LEGEND if name in shown])


def settings_table(meta: dict[str, Any]) -> str:
    """The run's settings as a readable table: unset ones left out, the others spelled out."""
    rows = []
    for key, value in json_safe(meta).items():
        if key == "backends" and isinstance(value, list):
            value = {side: backend or "as given"
                     for side, backend in zip("AB", value, strict=False)}
        text = _setting(value)
        if text:
            rows.append(f"<tr><th>{html.escape(key.replace('_', ' '))}</th>"
                        f"<td>{html.escape(text)}</td></tr>")
    return "<table class='settings'>" + "".join(rows) + "</table>"


def _setting(value: Any) -> str:
    if value is None or value == [] or value == {}:
        return ""
    if isinstance(value, dict):
        parts = [f"{key}: {_setting(item) or 'none'}" for key, item in value.items()]
        return "; ".join(parts)
    if isinstance(value, list):
        return ", ".join(_setting(item) or "none" for item in value)
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _html_table(report: Any) -> str:
    """The rows as one table, or one collapsible table per layer of a deep model."""
    heads = _columns(report)
    header = "<thead><tr>" + "".join(f"<th>{h}</th>" for h in heads) + "</tr></thead>"
    lines = [_html_row(report, index, heads) for index in range(len(report.rows))]
    groups = layer_groups(report.rows)
    if len(groups) == 1:
        return f"<table>{header}<tbody>" + "\n".join(lines) + "</tbody></table>"
    parts = []
    for group in groups:
        last = report.rows[group[-1]]
        broken = any(diverged(report.rows[i]) for i in group)
        title = f"{module_label(last.module)} ({last.module_type}): rows {group[0]}-{group[-1]}"
        title += ", diverged" if broken else ""
        parts.append(f"<details{' open' if broken else ''}><summary>{html.escape(title)}"
                     f"</summary><table class='layer'>{header}<tbody>"
                     + "\n".join(lines[i] for i in group) + "</tbody></table></details>")
    return "\n".join(parts)


def layer_groups(rows: list[Row], most: int = 40) -> list[list[int]]:
    """Row indices cut after each row named on the plot's axis: each group ends with its layer."""
    if len(rows) <= most:
        return [list(range(len(rows)))]
    ends = set(_axis_rows(rows, most))
    groups, current = [], []
    for index in range(len(rows)):
        current.append(index)
        if index in ends:
            groups.append(current)
            current = []
    return groups + ([current] if current else [])


def _columns(report: Any) -> list[str]:
    """The table's columns, leaving out those that would be empty in every row."""
    heads = ["#", "module (B)"]
    heads += ["A"] if any(r.how != "name" for r in report.rows) else []
    heads += ["type", "local", "propagated"]
    heads += ["amplification"] if any(r.amplification is not None for r in report.rows) else []
    heads += ["grad local", "grad propagated"] if report.meta.backward else []
    return heads


def _html_row(report: Any, index: int, heads: list[str]) -> str:
    r = report.rows[index]
    classes = []
    if r is report.first_divergence or r is report.first_grad_divergence:
        classes.append("first")
    elif any(x is not None and not x.ok for x in (r.local, r.grad_local)):
        classes.append("diverged")
    elif r.local is not None and r.local.verdict == "identical" and not diverged(r):
        classes.append("identical")  # greyed only when nothing in the row diverged
    name = "&nbsp;" * 2 * r.depth + html.escape(module_label(r.module))
    if r.entry is not None:
        name += f"<br><span class='entry'>{html.escape(entry_mark(r.entry))}</span>"
    for d in r.shapes:
        name += f"<br><span class='entry'>{html.escape(shape_difference(d))}</span>"
    for d in r.structure:
        name += ("<br><span class='structure'>structure differs at "
                 f"{html.escape(structure_difference(d))}</span>")
    cells = {"#": str(index), "module (B)": name,
             "A": html.escape(r.a_module if r.how != "name" else ""),
             "type": html.escape(r.module_type), "local": html_cell(r.local),
             "propagated": html_cell(r.propagated),
             "amplification": html.escape(_amplification(r.amplification)),
             "grad local": html_cell(r.grad_local),
             "grad propagated": html_cell(r.grad_propagated)}
    return (f"<tr class='{' '.join(classes)}' data-row='{index}'>"
            + "".join(f"<td>{cells[head]}</td>" for head in heads) + "</tr>")


def _amplification(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.3g}"


def html_cell(result: Result | None) -> str:
    if result is None:
        return "-"
    explanation = html.escape(result.explain(), quote=True)
    return f"<span title='{explanation}'>{html.escape(share_cell(result))}</span>"


def _identical(result: Result | None) -> bool:
    return result is not None and result.verdict == "identical"


def _axis_rows(rows: list[Row], most: int = 40) -> list[int]:
    """Rows to name on a plot's x axis: all when few, else the shallowest levels that fit."""
    depths = sorted({r.depth for r in rows})
    chosen: list[int] = []
    for depth in depths:
        candidate = [i for i, r in enumerate(rows) if r.depth <= depth]
        if len(candidate) > most:
            break
        chosen = candidate
    return chosen


def _spaced(indices: list[int], min_gap: int) -> list[int]:
    """``indices`` without those closer than ``min_gap`` to the last kept (labels overlap)."""
    kept: list[int] = []
    for index in reversed(indices):
        if not kept or kept[-1] - index >= min_gap:
            kept.append(index)
    return kept[::-1]


_COLOURS = ("#c0392b", "#2471a3")


def svg_plot(rows: list[Row], attributes: dict[str, str], title: str) -> str:
    """Log-scale plot of error / budget per row, one series per ``{name: row attribute}``."""
    # A result bit-identical to A shows "=" in the table: no share is plotted for it (its
    # error against the golden is A's own), only a hollow mark on the plot's floor.
    results = {name: [getattr(r, attr) for r in rows] for name, attr in attributes.items()}
    series = {name: [None if _identical(result) else headroom(result) for result in values]
              for name, values in results.items()}
    colours = dict(zip(series, _COLOURS, strict=False))
    finite = [v for values in series.values() for v in values
              if v is not None and 0 < v < math.inf]
    lo = math.floor(math.log10(min(finite + [1e-2])))
    hi = math.ceil(math.log10(max(finite + [10.0])))
    left, top, plot_h, step = 60, 30, 220, max(4, min(40, 900 // max(len(rows), 1)))
    labelled = _spaced(_axis_rows(rows), min_gap=max(1, math.ceil(13 / step)))
    label_h = 6 * max((len(module_label(rows[i].module)) for i in labelled), default=0) + 10
    width = max(left + step * max(len(rows), 1) + 30, 600)  # room for the title and legend
    height = top + plot_h + label_h + 30

    def x(i: int) -> float:
        return left + step * (i + 0.5)

    def y(value: float) -> float:
        clipped = min(max(value, 10.0**lo), 10.0**hi) if value > 0 else 10.0**lo
        return top + plot_h * (hi - math.log10(clipped)) / (hi - lo)

    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             f"role='img' aria-label='{html.escape(title)}'>",
             f"<text x='{left}' y='16'>{html.escape(title)} "
             "(log scale; above 1 breaks the budget)</text>"]
    for decade in range(lo, hi + 1):
        # The budget (1e0) is dashed and dark, the other decades light grid lines.
        stroke = "stroke='#555' stroke-dasharray='4 3'" if decade == 0 else "stroke='#ddd'"
        parts.append(f"<line x1='{left}' x2='{width - 20}' y1='{y(10.0**decade):.1f}' "
                     f"y2='{y(10.0**decade):.1f}' {stroke}/>")
        parts.append(f"<text x='{left - 6}' y='{y(10.0**decade) + 4:.1f}' text-anchor='end'>"
                     f"1e{decade}</text>")
    for name, values in series.items():
        points = [(x(i), y(v)) for i, v in enumerate(values) if v is not None]
        if points:
            path = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
            parts.append(f"<polyline class='series-{name}' fill='none' stroke='{colours[name]}' "
                         f"stroke-width='1.5' points='{path}'/>")
    for i, r in enumerate(rows):
        module = html.escape(r.module, quote=True)
        for offset, (name, values) in enumerate(series.items()):
            if _identical(results[name][i]):
                label = f"{module_label(r.module)}: {name} bit-identical to A (=)"
                parts.append(
                    f"<circle class='identical-{name}' data-module='{module}' cx='{x(i):.1f}' "
                    f"cy='{top + plot_h - 4 - 6 * offset:.1f}' r='2.5' fill='none' "
                    f"stroke='{colours[name]}'><title>{html.escape(label)}</title></circle>")
            elif values[i] is not None:
                label = f"{module_label(r.module)}: {name} error / budget = {ratio(values[i])}"
                parts.append(
                    f"<circle class='point-{name}' data-module='{module}' cx='{x(i):.1f}' "
                    f"cy='{y(values[i]):.1f}' r='3' fill='{colours[name]}'>"
                    f"<title>{html.escape(label)}</title></circle>")
    for i in labelled:  # module names on the x axis, a faint line at each
        label_y = top + plot_h + 8
        parts.append(f"<line x1='{x(i):.1f}' x2='{x(i):.1f}' y1='{top}' y2='{top + plot_h}' "
                     "stroke='#f0f0f0'/>")
        parts.append(f"<text class='axis-module' x='{x(i):.1f}' y='{label_y}' "
                     f"transform='rotate(60 {x(i):.1f} {label_y})'>"
                     f"{html.escape(module_label(rows[i].module))}</text>")
    legend_y = top + plot_h + label_h + 20
    for offset, (name, colour) in enumerate(colours.items()):
        parts.append(f"<rect x='{left + 140 * offset}' y='{legend_y - 9}' width='10' height='10' "
                     f"fill='{colour}'/><text x='{left + 140 * offset + 14}' y='{legend_y}'>"
                     f"{name}</text>")
    parts.append(f"<circle cx='{left + 140 * len(colours) + 5}' cy='{legend_y - 4}' r='3' "
                 f"fill='none' stroke='#555'/><text x='{left + 140 * len(colours) + 14}' "
                 f"y='{legend_y}'>on the floor: bit-identical to A (=)</text>")
    parts.append("</svg>")
    return "<figure>" + "".join(parts) + "</figure>"

