"""``diagnose --compile-b``: B compiled module by module names the module whose compiled
output leaves its budget (a change only the compiled path takes), in one process, for a
factory that returns a compiled model, and against a trace of the eager revision. Compiled
with ``aot_eager`` (see tests/golden/test_compiled.py); Inductor on a zoo model is ``slow``."""

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


def test_diagnose_compile_b_names_the_module_that_departs_under_compile(models, tmp_path,
                                                                        aot_eager):
    eager, planted = (f"{models / 'tiny_compiled.py'}:{name}" for name in ("eager", "planted"))
    report = tmp_path / "diagnosis.json"
    assert main(["diagnose", eager, planted, "--json", str(report)]) == 0  # eager: equal
    assert main(["diagnose", eager, planted, "--compile-b", "static", "--json",
                 str(report)]) == 1
    diagnosis = json.loads(report.read_text())
    assert diagnosis["first_divergence"]["module"] == "blocks.1.norm"
    assert diagnosis["first_grad_divergence"]["module"] == "blocks.1.norm"
    rows = {row["module"]: row for row in diagnosis["rows"]}
    # The search opened only what departed: the model, then block 1, then its norm.
    assert set(rows) == {"", "blocks.0", "blocks.1", "head", "blocks.1.norm", "blocks.1.qkv",
                         "blocks.1.out"}
    assert rows["blocks.0"]["local"]["ok"] and not rows["blocks.1.norm"]["local"]["ok"]
    assert diagnosis["meta"]["compile_b"] == "static"


def test_a_factory_returning_a_compiled_model_is_diagnosed_compiled(models, tmp_path,
                                                                   aot_eager):
    eager, compiled = (f"{models / 'tiny_compiled.py'}:{name}"
                       for name in ("eager", "planted_compiled"))
    report = tmp_path / "diagnosis.json"
    assert main(["diagnose", eager, compiled, "--json", str(report)]) == 1
    diagnosis = json.loads(report.read_text())
    assert diagnosis["first_divergence"]["module"] == "blocks.1.norm"
    assert diagnosis["meta"]["compile_b"] == "static"  # torch.compile(model, dynamic=False)


def test_record_against_a_compiled_revision_names_the_module(models, tmp_path, aot_eager):
    eager, planted = (f"{models / 'tiny_compiled.py'}:{name}" for name in ("eager", "planted"))
    trace, report = tmp_path / "base.tptrace", tmp_path / "diagnosis.json"
    assert main(["record", eager, "-o", str(trace)]) == 0
    assert main(["diagnose", planted, "--against", str(trace), "--compile-b", "static",
                 "--json", str(report)]) == 1
    assert json.loads(report.read_text())["first_divergence"]["module"] == "blocks.1.norm"


def test_one_model_against_itself_compiled(models, aot_eager, monkeypatch):
    # "Does compiling change my model?": A and B may be the same module; A stays eager.
    import torchparity as tp

    monkeypatch.syspath_prepend(str(models))
    import tiny_compiled

    model, inputs = tiny_compiled.planted()
    report = tp.diagnose(model, model, inputs, compile_b="static")
    assert report.first_divergence.module == "blocks.1.norm"
    assert "forward" not in vars(model.blocks[1].norm)  # left as it was


def test_a_compiled_decoding_is_pointed_at_the_check(models, capsys):
    eager, planted = (f"{models / 'tiny_compiled.py'}:{name}" for name in ("eager", "planted"))
    assert main(["diagnose", eager, planted, "--decode", "--compile-b"]) == 2
    assert "torchparity check --model ENTRY --compile" in capsys.readouterr().err


@pytest.mark.slow
def test_inductor_diagnosis_names_the_planted_norm_of_a_zoo_model(tmp_path):
    spec = compiled_models.write(tmp_path, "zoo_planted", compiled_models.ZOO_MODELS)
    report = tmp_path / "diagnosis.json"
    assert main(["diagnose", f"{spec}:eager", f"{spec}:planted", "--compile-b", "--json",
                 str(report)]) == 1
    diagnosis = json.loads(report.read_text())
    assert diagnosis["first_divergence"]["module"] == "decoder.layers.1.mlp_norm"
    rows = {row["module"]: row for row in diagnosis["rows"]}
    assert rows["decoder.layers.0"]["local"]["ok"]  # compiled, the rest stays within budget
