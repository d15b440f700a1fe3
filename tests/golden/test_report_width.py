"""The check's table in a log or a pipe: at most 80 columns, no case or backend name cut."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from torchparity import backends
from torchparity.golden.cells import REFERENCE, Cell, CheckResult
from torchparity.golden.report import Machines, check_page, render
from torchparity.golden.store import produced_by
from torchparity.reference import zoo

LONG_MODEL = "models.a_factory_whose_name_alone_takes_more_than_the_eighty_columns_of_a_log_line"


def table_of(cases: list[str], cells: list[Cell]) -> str:
    """The table ``torchparity check`` prints into a pipe for these cases and cells, every
    row a diverged output (the widest text a cell shows)."""
    results = [CheckResult(case, cell.backend, cell.dtype, cell.device, "logits", "forward",
                           "diverged", 1234.5, ok=False, reason="planted")
               for case in cases for cell in cells]
    out = io.StringIO()
    console = Console(file=out, soft_wrap=True)
    render(console, check_page(results, cells, 1.0, Machines(produced_by("cpu"), {})))
    return out.getvalue().split("\nFAIL ", 1)[0]


def case_column(table: str) -> str:
    """The first column of every table's rows, run together: a folded name joins up again."""
    return "".join(line.split("│")[1].strip() for line in table.splitlines()
                   if line.startswith("│"))


@pytest.mark.parametrize("cases", [zoo.names(), [*zoo.names()[:2], LONG_MODEL]])
def test_the_table_fits_80_columns_and_cuts_no_name(cases):
    cells = [REFERENCE, *(Cell(b, d) for d in ("fp32", "bf16") for b in backends.names()),
             *(Cell("sdpa", "fp32", compile=form) for form in ("dynamic", "static"))]
    table = table_of(cases, cells)
    assert max(len(line) for line in table.splitlines()) <= 80, table
    headers = {name.strip() for line in table.splitlines() if line.startswith("┃")
               for name in line.strip("┃").split("┃")}
    assert headers == {"case", "reference", *backends.names()}, table
    assert all(case in case_column(table) for case in cases), table
    assert "…" not in table
