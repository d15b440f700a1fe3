"""The check's report as one HTML page: the terminal's lines and table, under a legend."""

from __future__ import annotations

import html
from pathlib import Path

from torchparity.errors import UsageError
from torchparity.golden.report import SYMBOLS, TITLE, Page
from torchparity.pages import legend_paragraph, page

#: What a share after a symbol says, by example.
SHARES = (("17%", "the most of its budget an output of the cell used"),
          ("12x", "that many times its budget (a share of 10 or more)"),
          ("fp32, bf16, ...", "the dtype each line of a cell is run in"))
#: What each kind of column holds.
COLUMNS = (("reference", "the manual backend in float64, against the goldens: a change "
                         "there is a change of the model's math"),
           ("any other", "that attention backend, judged by the tolerance model against the "
                         "manual backend in the same dtype"))
#: A line of a cell is marked by its first symbol.
MARKS = {"✗": "failed", "n/a": "unavailable"}


def check_html_page(content: Page) -> str:
    """The check's report as one HTML page: lines, the table and its legend, lines after."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in content.headers)
    body = "".join("<tr>" + "".join(f"<td>{_cell(text)}</td>" for text in row) + "</tr>"
                   for row in content.rows)
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    return page(TITLE.split(":")[0],
                _paragraphs(content.before, "summary")
                + f"<p>{html.escape(TITLE.split(': ', 1)[1])}</p>" + table
                + legend_paragraph([*SYMBOLS, *SHARES], COLUMNS)
                + _paragraphs(content.after, "note"))


def write_html(path: Path, content: Page) -> None:
    """Write the check's report as an HTML page to ``path``, overwritten."""
    try:
        path.write_text(check_html_page(content), encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write --html {path}: {exc.strerror}") from None


def _cell(text: str) -> str:
    """A cell's lines, ``fp32 ✓ 17% [1]``, one under the other; failed or unavailable marked."""
    lines = []
    for line in text.split("\n"):
        symbol = next((mark for mark in MARKS if f" {mark}" in line), None)
        escaped = html.escape(line)
        lines.append(f"<span class='{MARKS[symbol]}'>{escaped}</span>" if symbol else escaped)
    return "<br>".join(lines)


def _paragraphs(lines: list[str], css: str) -> str:
    """One paragraph per line; a failure's line marked."""
    return "".join(f"<p class='{css}{' failed' if line.startswith('FAIL ') else ''}'>"
                   f"{html.escape(line)}</p>" for line in lines)
