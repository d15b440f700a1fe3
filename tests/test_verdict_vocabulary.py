"""One vocabulary of verdicts across every report: a diagnosis and a check, each rendered as
the terminal, JSON, Markdown, JUnit and HTML show them, agree row by row.

Each format is read back on its own terms (a symbol through its legend, a word as written)
and compared with the JSON's verdicts, in the words identical, within, diverged, structure
differs, not compared and could not run.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from io import StringIO
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

import torchparity as tp
from torchparity.ci import check_outcome, diagnosis_outcome, junit_xml, summary_markdown
from torchparity.cli import main
from torchparity.golden.cells import PLAIN_VERDICTS

SHIPPED = Path(__file__).resolve().parents[1] / "golden"
VOCAB, DIM = 16, 8

pytestmark = pytest.mark.usefixtures("single_thread")


def diagnosis_word(cell: str) -> str | None:
    """A diagnosis cell (terminal, Markdown, HTML) in words, by the legend they share."""
    cell = cell.strip("` ")
    if cell == "-":
        return None
    if cell == "=":
        return "identical"
    if cell.startswith("X"):
        return "diverged"
    if cell == "n/c":
        return "not compared"
    assert re.fullmatch(r"<?\d*\.?\d+(e[+-]\d+)?", cell), cell  # a share of the budget
    return "within"


def row_word(local: str | None, propagated: str | None, structure: bool) -> str:
    """A module's one verdict: diverged where either comparison did, else structure differs
    where it does, else the weaker of the two (within over identical)."""
    words = {w for w in (local, propagated) if w is not None}
    if "diverged" in words:
        return "diverged"
    if structure:
        return "structure differs"
    return next(w for w in ("within", "not compared", "identical") if w in words)


class Block(nn.Module):
    def __init__(self, as_list: bool) -> None:
        super().__init__()
        self.proj, self.as_list = nn.Linear(DIM, DIM), as_list

    def forward(self, x: torch.Tensor):
        h = torch.tanh(self.proj(x))
        return [h] if self.as_list else {"hidden": h}


class Tiny(nn.Module):
    """B's block returns another container (not compared), B's norm another epsilon (its
    own error diverges), the rest the same."""

    def __init__(self, revised: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block(as_list=revised)
        self.norm = nn.LayerNorm(DIM, eps=1e-1 if revised else 1e-5)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.block(self.embed(ids))
        return self.head(self.norm(out[0] if isinstance(out, list) else out["hidden"]))


class Cells(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs) -> None:
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "br" and self._cell is not None:
            self._cell.append("\n")

    def handle_endtag(self, tag) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data) -> None:
        if self._cell is not None:
            self._cell.append(data)


def test_a_diagnosis_reads_the_same_in_all_five_formats():
    ids = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    report = tp.diagnose(Tiny(False).eval(), Tiny(True).eval(), {"ids": ids},
                         backward=False, local="all", progress=False)
    # JSON: the reference, per module and comparison.
    data = json.loads(report.to_json())
    expected = {}
    for row in data["rows"]:
        cells = [(row[k] or {}).get("verdict") for k in ("local", "propagated")]
        expected[row["module"] or "(model)"] = cells
        assert {c for c in cells if c} <= set(PLAIN_VERDICTS)
    found = {word for cells in expected.values() for word in cells}
    assert {"identical", "diverged", "not compared"} <= found  # the vocabulary is exercised

    # Terminal: "#  local  prop.  module", cells apart by two spaces or more.
    console = Console(file=StringIO(), width=80)
    report.print(console)
    terminal = {}
    in_ops = False  # an op table sits under a row, closed by where the change enters
    for line in console.file.getvalue().splitlines():
        in_ops = (in_ops or " op of " in line) and not line.strip().startswith("It enters")
        parts = re.split(r"\s{2,}", line.strip())
        if not in_ops and len(parts) >= 4 and parts[0].isdigit():
            name = re.sub(r" \(.*", "", parts[3])
            terminal[name] = [diagnosis_word(parts[1]), diagnosis_word(parts[2])]
    assert terminal == expected

    # HTML: the module table, by its headings.
    cells = Cells()
    page = report.to_html()
    cells.feed(page[:page.index("</table>")])
    heads, *rows = [r for r in cells.rows if r]
    html_rows = {r[heads.index("module (B)")].split("\n")[0]: r for r in rows}
    assert {name: [diagnosis_word(r[heads.index(k)]) for k in ("local", "propagated")]
            for name, r in html_rows.items()} == expected

    # JUnit: one verdict per module, the rule of row_word over the JSON's two.
    outcome = diagnosis_outcome(report, "b against a")
    junit = {case.get("name"): case.find("properties/property").get("value")
             for case in ET.fromstring(junit_xml(outcome)).iter("testcase")}
    structure = {r.module or "(model)" for r in report.rows if r.structure}
    assert junit == {name: row_word(*cells, name in structure)
                     for name, cells in expected.items()}
    assert set(junit.values()) <= set(PLAIN_VERDICTS)

    # Markdown: the modules that diverged, their two cells.
    markdown = [line.split("|")[1:-1] for line in summary_markdown(outcome).splitlines()
                if line.startswith("| `")]
    assert markdown
    for name, _, local, propagated in markdown:
        assert [diagnosis_word(local), diagnosis_word(propagated)] == \
            expected[name.strip().strip("`")]


TERMINAL_SYMBOLS = {"≡": "identical", "✓": "within", "✗": "diverged", "n/a": "could not run"}


def test_a_check_reads_the_same_in_all_five_formats(tmp_path, capsys):
    """The zoo's llama-tiny, one backend that runs and one that cannot on the CPU."""
    report_path, page_path = tmp_path / "check.json", tmp_path / "check.html"
    assert main(["check", "--jobs", "1", "--golden-dir", str(SHIPPED), "--json",
                 str(report_path), "--html", str(page_path), "--case", "llama-tiny",
                 "--backend", "sdpa",
                 "--backend", "sdpa-cudnn", "--backend", "flex", "--dtype", "fp32"]) == 0
    terminal = capsys.readouterr().out
    results = json.loads(report_path.read_text())["results"]
    words = {(r["backend"], r["dtype"], r["output"]): r["plain_verdict"] for r in results}
    assert set(words.values()) <= set(PLAIN_VERDICTS)
    assert {"identical", "within", "could not run"} <= set(words.values())

    def cell_word(backend: str, dtype: str) -> str:
        """A cell's word from its outputs': diverged if one did, could not run if none ran,
        identical if all that ran are, else within."""
        outputs = {w for (b, d, _), w in words.items() if (b, d) == (backend, dtype)}
        ran = outputs - {"could not run"}
        if "diverged" in ran:
            return "diverged"
        if not ran:
            return "could not run"
        return "identical" if ran == {"identical"} else "within"

    # Terminal: each table cell "fp32 ✓ 17% [1]" under its backend; a backend that runs
    # nowhere here is named on a line of its own.
    table = [line for line in terminal.splitlines() if line.startswith(("┃", "│"))]
    heads = [h.strip() for h in table[0].strip("┃").split("┃")]
    for line in table[1:]:
        for head, cell in zip(heads, line.strip("│").split("│"), strict=True):
            if head in ("case",) or not cell.strip():
                continue
            dtype, symbol = cell.split()[:2]
            backend = "manual" if head == "reference" else head
            assert TERMINAL_SYMBOLS[symbol] == cell_word(backend, dtype), (head, cell)
    assert "sdpa-cudnn: n/a in every cell here" in terminal
    assert cell_word("sdpa-cudnn", "fp32") == "could not run"

    # HTML: the same table, a line per dtype in each cell, and a legend for every symbol.
    cells = Cells()
    page = page_path.read_text()
    cells.feed(page)
    heads, *rows = [r for r in cells.rows if r]
    assert [row[0] for row in rows] == ["llama-tiny"]
    shown = set()
    for row in rows:
        for head, cell in zip(heads[1:], row[1:], strict=True):
            for line in cell.split("\n"):
                dtype, symbol = line.split()[:2]
                backend = "manual" if head == "reference" else head
                assert TERMINAL_SYMBOLS[symbol] == cell_word(backend, dtype), (head, line)
                shown.add(symbol)
    assert shown >= {"≡", "✓"}
    assert all(f"<b>{symbol}</b> " in page for symbol in TERMINAL_SYMBOLS)
    assert "sdpa-cudnn: n/a in every cell here" in page

    # JUnit: one case per cell and output, in the same words as the JSON.
    from torchparity.golden.cells import CheckResult

    checked = [CheckResult(**{k: v for k, v in r.items() if k != "plain_verdict"})
               for r in results]
    outcome = check_outcome(checked, "the shipped goldens")
    junit = {case.get("name"): case.find("properties/property").get("value")
             for case in ET.fromstring(junit_xml(outcome)).iter("testcase")}
    assert junit == {f"{r.cell.label} {r.output}": words[r.backend, r.dtype, r.output]
                     for r in checked}

    # Markdown: one row per cell, its word as the terminal's.
    for line in summary_markdown(outcome).splitlines():
        if line.startswith("| `"):
            _, label, verdict, _ = [c.strip() for c in line.split("|")[1:-1]]
            backend, dtype, _ = label.split()
            backend = "manual" if backend == "reference" else backend
            assert verdict.removesuffix(", could not run in part") == cell_word(backend, dtype)
