"""A terminal table whose last column names modules, laid out so that no name is ever cut.

A CI log is searched for module names, so a name broken across two lines is lost. The cells
before the name are as narrow as their contents; a name is indented by its depth as far as
the width allows (the indentation yields first), the words of a longer text (a fold's range,
``(shape differs)``) wrap at spaces, and a word that does not fit beside the cells gets a line
of its own. A name wider than the whole line is printed whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Between two columns, as rich's tables space them.
_GAP = "  "


@dataclass(frozen=True)
class Line:
    """One row of the table: its cells, the text of its last column (a module name), how deep
    the module is, a rich style (None: plain) and laid-out lines printed under it (a module's
    op table)."""

    cells: list[str]
    name: str
    depth: int = 0
    style: str | None = None
    below: tuple[tuple[str, str | None], ...] = ()


def layout(heads: list[str], lines: list[Line], width: int, right: int = 1
           ) -> list[tuple[str, str | None]]:
    """The table as text lines with their styles, ``width`` columns wide: a header, a rule,
    then every line (the first ``right`` columns right-aligned, the others left)."""
    widths = [max([len(head)] + [len(line.cells[i]) for line in lines])
              for i, head in enumerate(heads[:-1])]

    def prefix(cells: list[str]) -> str:
        aligned = [c.rjust(w) if i < right else c.ljust(w)
                   for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return " " + _GAP.join(aligned) + _GAP

    out = [(prefix(heads[:-1]) + heads[-1], None)]
    rows = [[(text, line.style) for text in wrapped_name(prefix(line.cells), line.name, line.depth,
                                                    width)] for line in lines]
    rule = min(width, max(len(text) for text, _ in [*out, *(t for r in rows for t in r)])) - 1
    body = [text for line, row in zip(lines, rows, strict=True) for text in [*row, *line.below]]
    return [*out, (" " + "─" * rule, None), *body]


def wrapped_name(prefix: str, name: str, depth: int, width: int) -> list[str]:
    """``prefix`` then ``name`` indented by ``depth``, in lines of at most ``width`` where the
    words allow (see the module's docstring); no word is cut."""
    column = len(prefix)
    if column + len(name) <= width:
        return [prefix + " " * min(depth, width - column - len(name)) + name]
    lines: list[str] = []
    head, words = prefix, ""
    for word in name.split(" "):
        if words and len(head) + len(words) + 1 + len(word) <= width:
            words += " " + word
            continue
        if words:
            lines.append(head + words)
            head, words = " " * column, ""
        if len(head) + len(word) <= width:
            words = word
            continue
        if head.strip():
            lines.append(head.rstrip())  # the cells, the name below them
        lines.append(" " * max(0, min(column, width - len(word))) + word)
        head = " " * column
    if words:
        lines.append(head + words)
    return lines


def print_lines(console: Any, lines: list[tuple[str, str | None]]) -> None:
    """Print laid-out lines to a ``rich.console.Console`` as they are (never wrapped or
    cropped)."""
    from rich.text import Text

    for text, style in lines:
        console.print(Text(text, style=style or ""), no_wrap=True, overflow="ignore",
                      crop=False)
