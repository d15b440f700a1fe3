"""Rendering of the diagnosis: terminal table, JSON and a self-contained HTML page."""

from __future__ import annotations

import copy
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
from torch import nn

import torchparity as tp
from torchparity.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(self.norm(x)).relu())


@pytest.fixture(scope="module")
def report() -> tp.DiagnosisReport:
    torch.manual_seed(0)
    model_a = Tiny()
    model_b = copy.deepcopy(model_a)
    model_b.norm.eps = 1e-2  # the planted change
    return tp.diagnose(model_a, model_b, (torch.randn(4, 8),))


class PageParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        self.tags.append((tag, dict(attrs)))


def parse(page: str) -> list[tuple[str, dict[str, str]]]:
    parser = PageParser()
    parser.feed(page)
    return parser.tags


def test_html_is_self_contained_and_plots_every_row(report, tmp_path: Path) -> None:
    page = report.to_html(tmp_path / "report.html")
    assert (tmp_path / "report.html").read_text(encoding="utf-8") == page
    tags = parse(page)
    assert not [t for t, _ in tags if t in ("script", "link", "img", "iframe")]
    assert not [a for _, a in tags if "src" in a or "href" in a]
    svgs = [a for t, a in tags if t == "svg"]
    assert len(svgs) == 2  # forward and gradient plots
    modules = [r.module for r in report.rows]
    for series in ("local", "propagated"):
        # One mark per row, in order: its share of the budget, or on the floor for "=".
        plotted = [a["data-module"] for t, a in tags if t == "circle" and
                   a.get("class") in (f"point-{series}", f"identical-{series}")]
        assert plotted[:len(modules)] == modules
    table_rows = [a for t, a in tags if t == "tr" and "data-row" in a]
    assert len(table_rows) == len(report.rows)
    first = report.rows.index(report.first_divergence)
    assert "first" in table_rows[first]["class"]


def test_plot_puts_the_culprit_above_the_budget_line(report) -> None:
    tags = parse(report.to_html())
    budget_y = next(float(a["y1"]) for t, a in tags
                    if t == "line" and a.get("stroke-dasharray"))  # the dashed line at 1
    local = {a["data-module"]: float(a["cy"]) for t, a in tags
             if t == "circle" and a.get("class") in ("point-local", "identical-local")}
    assert local["norm"] < budget_y  # SVG y grows downwards: above the line = over budget
    assert local["fc1"] > budget_y


def test_terminal_and_json_name_the_first_divergence(report) -> None:
    text = report.render()
    assert "First divergence: norm (LayerNorm)" in text
    assert text.count("\n") > len(report.rows)
    data = json.loads(report.to_json())
    assert data["first_divergence"]["module"] == data["first_grad_divergence"]["module"] == "norm"
    assert [r["module"] for r in data["rows"]] == [r.module for r in report.rows]
    assert data["rows"][0]["local"]["verdict"] == "diverged"


ENCDEC_FACTORY = """
from torchparity.reference import build_model, sequence_loss, zoo

def make_a():
    cfg = zoo.get("encdec-prenorm").config
    batch = zoo.make_batch(cfg, batch_size=2, seq_len=8, seed=0)
    return build_model(cfg, seed=0), batch, sequence_loss

def make_b():
    model, batch, loss = make_a()
    model.decoder.layers[1].cross_attn_norm.eps = 1e-3
    return model, batch, loss
"""


def test_cli_report_in_80_columns_shows_every_module_name_whole(tmp_path: Path, capsys,
                                                                monkeypatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # as in a CI log: no terminal, 80 columns
    (tmp_path / "encdec.py").write_text(ENCDEC_FACTORY)
    entry = f"{tmp_path}/encdec.py"
    code = main(["diagnose", f"{entry}:make_a", f"{entry}:make_b", "--json",
                 str(tmp_path / "report.json")])
    assert code == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80
    words = set(out.split())
    modules = [r["module"] for r in json.loads((tmp_path / "report.json").read_text())["rows"]]
    assert len(modules) > 60 and "decoder.layers.1.cross_attn.q_proj" in modules
    # Deep models fold rows that agree (tests/diagnosis/test_report_folding.py); every name
    # printed is whole, the divergence's among them, and the JSON has every row.
    printed = [w.rstrip(").,") for w in words if w.startswith(("encoder.", "decoder."))]
    assert printed and [w for w in printed if w not in modules] == []
    assert "decoder.layers.1.cross_attn_norm" in words


def test_html_axis_names_modules_and_deep_models_collapse_by_layer(report) -> None:
    tags = parse(report.to_html())
    axis = [a for t, a in tags if t == "text" and a.get("class") == "axis-module"]
    assert len(axis) == 2 * len(report.rows)  # a small model: every module named, both plots
    page = report.to_html()
    for r in report.rows:
        assert f">{r.module or '(model)'}</text>" in page
    assert "<details open>" not in page.split("<table")[0]  # one plain table when small


def test_deep_model_html_collapses_by_layer_and_names_layers_on_the_axis() -> None:
    from torchparity.reference import build_model, zoo

    cfg = zoo.get("llama-tiny").config.replace(n_layers=4)
    model_a = build_model(cfg, seed=0)
    model_b = copy.deepcopy(model_a)
    model_b.decoder.layers[2].mlp_norm.eps = 1e-2  # the planted change
    batch = zoo.make_batch(cfg, batch_size=2, seq_len=8, seed=0)
    report = tp.diagnose(model_a, model_b, batch, backward=False)
    assert len(report.rows) > 40
    page = report.to_html()
    tags = parse(page)
    axis = [a for t, a in tags if t == "text" and a.get("class") == "axis-module"]
    assert 0 < len(axis) <= 40
    for layer in range(4):
        assert f">decoder.layers.{layer}</text>" in page
    sections = page.split("<details")[1:]
    assert len(sections) >= 4
    opened = [s for s in sections if s.startswith(" open>")]
    assert opened and all("decoder.layers.2" in s.split("</summary>")[0] for s in opened[:1])
    assert "decoder.layers.2.mlp_norm" in opened[0]
    assert page.index("<svg") < page.index("<table")  # the error plot first


class CellParser(HTMLParser):
    """The text of each table cell, by its column's heading, and the legend's text."""

    def __init__(self) -> None:
        super().__init__()
        self.heads: list[str] = []
        self.rows: list[list[str]] = []
        self.legend = ""
        self._cell: list[str] | None = None
        self._in_legend = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "tr":
            self.rows.append([])
        if tag in ("th", "td"):
            self._cell = []
        if tag == "p" and "legend" in dict(attrs).get("class", ""):
            self._in_legend = True

    def handle_endtag(self, tag: str) -> None:
        if tag in ("th", "td") and self._cell is not None:
            text = " ".join("".join(self._cell).split())
            (self.heads if tag == "th" and not self.heads_done else self.rows[-1]).append(text)
            self._cell = None
        if tag == "thead":
            self.heads_done = True
        if tag == "p":
            self._in_legend = False

    heads_done = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._in_legend:
            self.legend += data


def test_html_explains_every_symbol_has_no_empty_column_and_its_chart_agrees(report):
    page = report.to_html()
    cells = CellParser()
    # The module table and its legend (an op table may follow them).
    cells.feed(page[:page.index("</p>", page.index("class='note legend'")) + 4])
    rows = [row for row in cells.rows if len(row) == len(cells.heads)]
    assert rows and len(rows) == len(report.rows)
    for column, head in enumerate(cells.heads):
        if head not in ("#", "module (B)", "type"):
            assert any(row[column] not in ("", "-") for row in rows), head  # never all empty
            assert head in cells.legend  # every column is explained
    symbols = {cell.split(" ")[0] if cell.startswith("X") else cell[:1]
               for row in rows for cell in row[cells.heads.index("type") + 1:]}
    for symbol in symbols - {""}:
        if symbol.isdigit() or symbol == ".":
            symbol = "0.15"  # a plain share, explained by its example
        assert symbol in cells.legend, symbol
    # A cell marked "=" is bit-identical to A: the chart plots no share of the budget for it.
    tags = parse(page)
    identical = {r.module for r in report.rows if r.local is not None
                 and r.local.verdict == "identical"}
    plotted = {a["data-module"] for t, a in tags if t == "circle"
               and a.get("class") == "point-local"}
    floor = {a["data-module"] for t, a in tags if t == "circle"
             and a.get("class") == "identical-local"}
    assert identical and not identical & plotted and identical <= floor
    settings = page.split("<summary>settings</summary>")[1]
    assert "null" not in settings and "A: as given" in settings
