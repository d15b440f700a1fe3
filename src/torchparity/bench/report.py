"""Tables of a ``torchparity bench`` result, for the terminal (rich) and for Markdown.

Both draw the same :func:`sections`, so the terminal and ``BENCHMARKS.md`` cannot disagree.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from torchparity.bench.host import describe_machine
from torchparity.bench.rounds import Document, Row
from torchparity.bench.stages import OTHER, REPORT, RUNS, STAGES

if TYPE_CHECKING:  # rich is imported when a table is drawn
    from rich.console import Console
    from rich.table import Table

Section = tuple[str, list[str], list[list[str]]]  # title, headers, rows of cells


def sections(result: Document) -> list[Section]:
    """The result's tables as plain strings: throughput, diagnose, check, twins and targets."""
    return [
        _throughput(result["throughput"], result["settings"]["compile"]),
        _diagnose(result["diagnose"]),
        _diagnose_split(result["diagnose"], result["decode"]),
        _decode(result["decode"]),
        _check(result["check"]),
        _twins(result["twins"]),
        _targets(result["targets"]),
    ]


def to_markdown(result: Document) -> str:
    """All tables as GitHub Markdown, preceded by the machine they ran on."""
    machine = result["machine"]
    lines = [f"Machine: {describe_machine(machine)}", ""]
    for title, headers, rows in sections(result):
        lines += [f"#### {title}", "", _md_row(headers), _md_row(["---"] * len(headers))]
        lines += [_md_row(row) for row in rows]
        lines.append("")
    return "\n".join(lines)


def print_bench_tables(result: Document, console: Console) -> None:
    """Print every table with rich on ``console``."""
    from rich.table import Table

    console.print(f"machine: {describe_machine(result['machine'])}", markup=False)
    for title, headers, rows in sections(result):
        table = Table(title=title, title_justify="left")
        for header in headers:
            table.add_column(header, overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)


def _md_row(cells: list[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


# --------------------------------------------------------------------------------------------
# Cells


def _num(value: float | None, digits: int = 3) -> str:
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:,.0f}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def _mib(value: int | None) -> str:
    return "—" if value is None else f"{value / 2**20:,.1f}"


def _remark(row: Row) -> str:
    return row.get("reason") or row.get("note") or ""


def _table(title: str, columns: list[tuple[str, Callable[[Row], str]]],
           rows: list[Row]) -> Section:
    return title, [name for name, _ in columns], [[cell(row) for _, cell in columns]
                                                  for row in rows]


def _size(row: Row) -> str:
    if "d_model" not in row:
        return row.get("size", "")
    return (f"{row['size']}: d{row['d_model']}×{row['n_layers']}L, "
            f"{row['batch_size']}×{row['seq_len']}")


def _throughput(rows: list[Row], compiled: bool) -> Section:
    columns = [
        ("model", lambda r: r.get("model", "")),
        ("size", _size),
        ("dtype", lambda r: r.get("dtype", "")),
        ("backend", lambda r: r.get("backend", "")),
        ("tok/s", lambda r: _num(r.get("tok_per_s"))),
        ("× manual", lambda r: _ratio(r.get("ratio_vs_manual"))),
        ("step ms", lambda r: _num(1e3 * r["step_s"]) if "step_s" in r else "—"),
        ("spread", lambda r: f"{100 * r['spread']:.0f}%" if "spread" in r else "—"),
        ("first step s", lambda r: _num(r.get("first_step_s"))),
        ("peak MiB", lambda r: _mib(r.get("peak_bytes"))),
        ("mem × manual", lambda r: _ratio(r.get("peak_vs_manual"))),
    ]
    if compiled:
        columns += [(name, lambda r, key=key: str(r.get(key, "—")))
                    for name, key in (("graphs", "graphs"), ("breaks", "graph_breaks"),
                                      ("recompiles", "recompiles"))]
    columns.append(("note", _remark))
    return _table("Backend throughput (forward+backward)", columns, rows)


def _diagnose(rows: list[Row]) -> Section:
    columns = [
        ("model", lambda r: r.get("model", "")),
        ("size", _size),
        ("dtype", lambda r: r.get("dtype", "")),
        ("plain s", lambda r: _num(r.get("plain_s"))),
        ("diagnose s", lambda r: _num(r.get("diagnose_s"))),
        ("time × plain", lambda r: _ratio(r.get("diagnose_time_ratio"))),
        ("streaming s", lambda r: _num(r.get("stream_s"))),
        ("time × plain", lambda r: _ratio(r.get("stream_time_ratio"))),
        ("--against s", lambda r: _num(r.get("against_s"))),
        ("time × plain B", lambda r: _ratio(r.get("against_time_ratio"))),
        ("plain MiB", lambda r: _mib(r.get("plain_peak_bytes"))),
        ("diagnose MiB", lambda r: _mib(r.get("diagnose_peak_bytes"))),
        ("mem × plain", lambda r: _ratio(r.get("diagnose_peak_ratio"))),
        ("streaming MiB", lambda r: _mib(r.get("stream_peak_bytes"))),
        ("mem × plain", lambda r: _ratio(r.get("stream_peak_ratio"))),
        ("note", _remark),
    ]
    return _table("Cost of diagnose (manual vs sdpa models; plain = forward+backward of both)",
                  columns, rows)


def _diagnose_split(rows: list[Row], decode_rows: list[Row]) -> Section:
    columns = [("model", lambda r: r.get("model", "")), ("size", _size),
               ("capture", lambda r: r.get("capture", ""))]
    columns += [(stage, lambda r, stage=stage: _ratio(r["split"].get(stage)))
                for stage in (RUNS, *STAGES, OTHER, REPORT)]
    split_rows = [{**r, "capture": capture, "split": r[f"{key}_split"]}
                  for r in rows if r.get("status") == "ok"
                  for capture, key in (("full", "diagnose"), ("streaming", "stream"),
                                       ("full, a divergence planted in B", "planted"),
                                       ("full, a gradient-only divergence planted in B",
                                        "planted_grad"),
                                       ("--against (× plain B)", "against"))
                  if f"{key}_split" in r]
    # A decoding's record of A (its runs with every step captured) counts as runs.
    split_rows += [{**r, "capture": f"record + --against, {r['search']} decoding (× plain "
                                    "decodings)", "split": r["diagnosis_split"]}
                   for r in decode_rows if "diagnosis_split" in r]
    return _table("Where diagnose's time goes (× plain forward+backward of both models)",
                  columns, split_rows)


def _decode(rows: list[Row]) -> Section:
    columns = [
        ("model", lambda r: r.get("model", "")),
        ("size", _size),
        ("dtype", lambda r: r.get("dtype", "")),
        ("steps", lambda r: str(r.get("steps", ""))),
        ("search", lambda r: r.get("search", "greedy")),
        ("plain s", lambda r: _num(r.get("plain_s"))),
        ("record + diagnose s", lambda r: _num(r.get("diagnosis_s"))),
        ("× plain", lambda r: _ratio(r.get("decode_time_ratio"))),
        ("note", _remark),
    ]
    return _table("Cost of a decoding diagnosis (record --decode of A, then diagnose --against "
                  "of B; plain = a decoding of A and one of B, a beam search of A and B along "
                  "its choices with beams)", columns, rows)


def _check(rows: list[Row]) -> Section:
    columns = [
        ("command", lambda r: r.get("command", "")),
        ("wall s", lambda r: _num(r.get("wall_s"))),
        ("CPU s", lambda r: _num(r.get("cpu_s"))),
        ("exit", lambda r: str(r.get("exit_code", "—"))),
        ("logical cores", lambda r: str(r.get("logical_cores", ""))),
        ("note", _remark),
    ]
    return _table("Wall time of torchparity check", columns, rows)


def _twins(rows: list[Row]) -> Section:
    columns = [
        ("examples", lambda r: str(r.get("examples", ""))),
        ("result", lambda r: r.get("result", "")),
        ("wall s", lambda r: _num(r.get("wall_s"))),
        ("CPU s", lambda r: _num(r.get("cpu_s"))),
        ("1-min load before, after", lambda r: _loads(r)),
        ("logical cores", lambda r: str(r.get("logical_cores", ""))),
        ("note", _remark),
    ]
    commands = sorted({r["command"] for r in rows if "command" in r})
    return _table(f"A twins search ({'; '.join(commands) or 'not run'})", columns, rows)


def _loads(row: Row) -> str:
    loads = [row.get("load_before"), row.get("load_after")]
    return ", ".join(str(load[0]) for load in loads) if all(loads) else "—"


def _targets(rows: list[Row]) -> Section:
    verdict = {True: "met", False: "MISSED", None: "not measured"}
    columns = [
        ("target", lambda r: r["description"]),
        ("where", lambda r: r["where"]),
        ("limit", lambda r: r["limit"]),
        ("measured", lambda r: _num(r["measured"], 4)),  # 1.496 must not read as 1.5
        ("result", lambda r: verdict[r["met"]]),
        ("note", lambda r: r.get("note", "")),
    ]
    return _table("Targets", columns, rows)


# --------------------------------------------------------------------------------------------
# bench --model


def model_throughput_table(name: str, device: str, rows: list[Row]) -> Table:
    """``bench --model``'s tokens/s and first step per backend and dtype, as a rich table."""
    from rich.table import Table

    table = Table(title=f"{name} on {device}: one forward, loss and backward per step",
                  title_justify="left")
    for column in ("backend", "dtype", "tokens/s", "step ms", "first step s", "note"):
        table.add_column(column, no_wrap=column != "note")
    for r in rows:
        if r["status"] == "ok":
            table.add_row(r["backend"], r["dtype"], f"{r['tokens_per_s']:,.0f}",
                          f"{r['step_s'] * 1e3:.2f}", f"{r['first_step_s']:.3f}",
                          f"spread {r['spread']:.0%}")
        else:
            table.add_row(r["backend"], r["dtype"], "n/a", "", "", r["reason"])
    return table


def at_size_lines(cost: Document) -> str:
    """The plain step, golden update and check of one model (``at_size.measure``), as text."""
    def mib(n: float) -> str:
        return f"{n / 2**20:,.0f} MiB"

    plain, golden, check = cost["plain"], cost["golden"], cost["check"]
    verdict = "all cells pass" if not check["failed"] else f"failed: {', '.join(check['failed'])}"
    return "\n".join([
        f"{cost['model']} ({cost['parameters']:,} parameters), each in its own process:",
        f"  plain forward+backward: {plain['step_s']:.2f} s (factory {plain['load_s']:.1f} s, "
        f"first step {plain['first_step_s']:.2f} s), peak {mib(plain['peak_bytes'])}",
        f"  golden update: {golden['s']:.1f} s = {golden['steps']:.1f} plain steps, peak "
        f"{mib(golden['peak_bytes'])}, goldens {golden['bytes'] / 1e6:.1f} MB",
        f"  check ({check['cells']} cells, {', '.join(cost['dtypes'])}): {check['s']:.1f} s = "
        f"{check['steps']:.1f} plain steps, peak {mib(check['peak_bytes'])}; {verdict}"])


def model_compiled_table(name: str, device: str, rows: list[Row]) -> Table:
    """``bench --model --compile``'s rows against eager, as a rich table."""
    from rich.table import Table

    table = Table(title=f"{name} on {device}, compiled: the first step with its compiling, "
                        "graphs/graph breaks/recompiles, steady speed against the same "
                        "backend eagerly", title_justify="left")
    for column in ("backend", "dtype", "compile", "tok/s", "x eager", "step ms", "first s",
                   "compiling s", "g/b/r", "note"):
        table.add_column(column, overflow="fold")
    for r in rows:
        if r["status"] != "ok":
            table.add_row(r["backend"], r["dtype"], r["compile"], "n/a", "", "", "", "", "",
                          r["reason"])
            continue
        steady = (f"{r['steady_recompiles']} recompile(s) after the first step"
                  if r["steady_recompiles"] else "")
        table.add_row(r["backend"], r["dtype"], r["compile"], f"{r['tokens_per_s']:,.0f}",
                      f"{r['vs_eager']:.2f}", f"{r['step_s'] * 1e3:.2f}",
                      f"{r['first_step_s']:.1f}", f"{r['compile_s']:.1f}",
                      f"{r['graphs']}/{r['graph_breaks']}/{r['recompiles']}",
                      "; ".join(p for p in (f"spread {r['spread']:.0%}", steady) if p))
    return table
