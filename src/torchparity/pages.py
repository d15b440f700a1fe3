"""Self-contained HTML pages (inline CSS, no script): the shell and legend every report shares."""

from __future__ import annotations

import html
from collections.abc import Iterable

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font: 12px ui-monospace, monospace; }
th, td { padding: 2px 8px; border-bottom: 1px solid #eee; text-align: left; }
tr.diverged td { background: #fde8e8; } tr.first td { background: #f8b4b4; font-weight: bold; }
tr.identical td { color: #999; }
.summary { font-size: 16px; margin: 1em 0; } .note { color: #666; }
svg text { font: 11px sans-serif; }
table.layer { table-layout: fixed; width: 100%; } summary { cursor: pointer; margin: 4px 0; }
table.layer td { overflow-wrap: anywhere; } table.layer th:nth-child(1) { width: 3em; }
table.layer th:nth-child(2) { width: 28%; } table.layer th:nth-child(4) { width: 14%; }
.entry { color: #a00; } .structure { color: #765; }
td .failed { background: #fde8e8; font-weight: bold; } td .unavailable { color: #999; }
p.note { margin: 0.3em 0; } p.failed { color: #a00; }
table.ops td:nth-child(-n+5) { white-space: nowrap; }
"""


def page(title: str, body: str, css: str = "") -> str:
    """A self-contained page: ``title`` as its heading, ``body`` under it, all CSS inline."""
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title><style>{CSS}{css}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{body}</body></html>\n")


def legend_paragraph(symbols: Iterable[tuple[str, str]],
                     columns: Iterable[tuple[str, str]] = ()) -> str:
    """What each ``(symbol, meaning)`` and ``(column, what it holds)`` says, in one paragraph."""
    items = [*(f"<b>{html.escape(symbol)}</b> {html.escape(text)}" for symbol, text in symbols),
             *(f"<b>{html.escape(name)}</b>: {html.escape(text)}" for name, text in columns)]
    return "<p class='note legend'>" + "; ".join(items) + "</p>"
