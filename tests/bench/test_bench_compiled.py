"""``bench --model ENTRY --compile``: per backend, each compile form's first step with its
compiling, its graphs, breaks and recompiles, and its steady speed beside the same backend
eagerly. Speeds are not asserted (a benchmark, not a timed test); what compiling did is."""

from __future__ import annotations

import json

import compiled_models
from torchparity.cli import main


def test_bench_model_compile_reports_first_step_recompiles_and_speed(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.setenv("TORCHPARITY_COMPILER", "aot_eager")  # bookkeeping, not Inductor
    entry = f"{compiled_models.write(tmp_path)}:eager"
    report = tmp_path / "bench.json"
    assert main(["bench", "--model", entry, "--compile", "--backend", "sdpa", "--skip",
                 "check", "--rounds", "1", "--json", str(report)]) == 0
    rows = json.loads(report.read_text())["compiled"]
    assert [(r["backend"], r["compile"], r["status"]) for r in rows] == [
        ("sdpa", "dynamic", "ok"), ("sdpa", "static", "ok")]
    for row in rows:
        # One graph for forward and backward, compiled in the first step; the same shapes
        # again never recompile.
        assert (row["graphs"], row["graph_breaks"], row["recompiles"]) == (1, 0, 0)
        assert row["steady_recompiles"] == 0
        # Compiling took time; its share of the first step is not asserted: dynamo times it
        # with its own clock, and under load the two clocks part by more than nothing.
        assert row["compile_s"] > 0 and row["first_step_s"] > 0
        assert row["tokens_per_s"] > 0 and row["vs_eager"] > 0
    assert "x eager" in capsys.readouterr().out
