"""``check --compile``: compiled cells judged like eager ones, with their graphs, breaks and
recompiles (per decoding step too); a change that only the compiled path takes fails the
compiled cells alone.

Most tests compile with ``aot_eager`` (dynamo and AOTAutograd, without Inductor's code
generation): the bookkeeping and the planted change are the same, at a fraction of the cost.
One test runs Inductor on a tiny model; the zoo and ``transformers`` models under Inductor are
``slow``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import compiled_models
from torchparity.cli import main


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("compiled")
    compiled_models.write(folder)
    return folder


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setenv("TORCHPARITY_COMPILER", "aot_eager")


def _check(models: Path, tmp_path: Path, entry: str, *args: str) -> tuple[int, dict]:
    """Goldens of ``entry`` (made under the planted factory's own name: the eager math is the
    same), then ``check --model`` with ``args``; exit status and JSON."""
    golden = tmp_path / "golden"
    spec = f"{models / 'tiny_compiled.py'}:{entry}"
    assert main(["golden", "update", "--model", spec, "--golden-dir", str(golden)]) == 0
    report = tmp_path / "check.json"
    status = main(["check", "--model", spec, "--golden-dir", str(golden), "--jobs", "1",
                   "--dtype", "fp32", "--json", str(report), *args])
    return status, json.loads(report.read_text())


def test_compiled_cells_pass_with_their_counts_beside_the_eager_ones(models, tmp_path, capsys,
                                                                     aot_eager):
    status, report = _check(models, tmp_path, "eager", "--backend", "manual", "--backend",
                            "sdpa", "--compile", "static")
    assert status == 0
    compiled = [r for r in report["results"] if r["compile"]]
    assert {(r["backend"], r["compile"]) for r in compiled} == {("manual", "static"),
                                                               ("sdpa", "static")}
    for row in compiled:
        assert row["compiled"]["compiler"] == "aot_eager" and row["compiled"]["graphs"] >= 1
        assert row["compiled"]["graph_breaks"] == 0 and row["compiled"]["failure"] is None
    out = capsys.readouterr().out
    assert "fp32 static" in out and "graphs/graph breaks/recompiles" in out


def test_a_change_taken_only_under_compile_fails_the_compiled_cells_alone(models, tmp_path,
                                                                          capsys, aot_eager):
    status, report = _check(models, tmp_path, "planted", "--backend", "sdpa")
    assert status == 0, capsys.readouterr().out  # eager, the planted branch is never taken
    status, report = _check(models, tmp_path, "planted", "--backend", "sdpa", "--compile",
                            "static")
    failed = {(r["backend"], r["compile"], r["output"]) for r in report["results"]
              if not r["ok"]}
    assert status == 1
    assert failed == {("sdpa", "static", "outputs"), ("sdpa", "static", "loss"),
                      ("sdpa", "static", "grads")}
    assert "FAIL tiny_compiled.planted sdpa fp32 cpu compiled static outputs" in (
        capsys.readouterr().out)


def test_zoo_decoding_under_compile_is_judged_and_counted_step_by_step(tmp_path, capsys,
                                                                      aot_eager):
    report = tmp_path / "check.json"
    assert main(["check", "--case", "llama-tiny", "--backend", "manual", "--dtype", "fp32",
                 "--compile", "static", "--jobs", "1", "--json", str(report)]) == 0
    decode = next(r for r in json.loads(report.read_text())["results"]
                  if r["compile"] and r["output"] == "decode")
    steps = decode["compiled"]["steps"]
    # Static: the prompt and every later length compile anew (the first compile of the cell
    # was its training call); each step is judged on its own against the golden.
    assert [len(step["recompiles"]) for step in steps] == [1, 1, 1, 1]
    assert [step["length"] for step in steps] == [12, 13, 14, 15]
    assert all(step["verdict"] in ("within", "identical") for step in steps)
    out = capsys.readouterr().out
    assert "static: 1 1 1 1 recompile(s), every step in 1 cell(s)" in out
    assert "recompiles at every call of the model (each new length compiles anew" in out


def test_inductor_reorderings_pass_under_the_tolerance_model(models, tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHPARITY_COMPILER", raising=False)
    status, report = _check(models, tmp_path, "eager", "--backend", "sdpa", "--compile",
                            "static")
    compiled = [r for r in report["results"] if r["compile"]]
    assert status == 0 and compiled
    assert all(r["compiled"]["compiler"] == "inductor" and r["verdict"] in ("within",
                                                                            "identical")
               for r in compiled)
