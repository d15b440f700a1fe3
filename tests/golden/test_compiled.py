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


def test_compiled_decoding_is_judged_and_counted_step_by_step(tmp_path, capsys, aot_eager):
    # A reference decoder as a user's model: decoded by the built-in step of the step protocol
    # (its KV cache, fed the golden's tokens), the compiled model called at each step.
    spec = f"{compiled_models.write(tmp_path, 'decoders', compiled_models.ZOO_MODELS)}"
    golden, report = tmp_path / "golden", tmp_path / "check.json"
    assert main(["golden", "update", "--model", f"{spec}:one_layer", "--golden-dir",
                 str(golden)]) == 0
    assert main(["check", "--model", f"{spec}:one_layer", "--golden-dir", str(golden),
                 "--backend", "sdpa", "--dtype", "fp32", "--compile", "static", "--jobs", "1",
                 "--json", str(report)]) == 0
    decode = next(r for r in json.loads(report.read_text())["results"]
                  if r["compile"] and r["output"] == "decode")
    steps = decode["compiled"]["steps"]
    # Static: the prompt (its first call without gradients) and every later length compile
    # anew; each step is judged on its own against the golden.
    assert [step["length"] for step in steps] == [12, 13, 14, 15, 16]
    assert [len(step["recompiles"]) for step in steps] == [1, 1, 1, 1, 1]
    assert all(step["verdict"] in ("within", "identical") for step in steps)
    phases = [call["phase"] for call in decode["compiled"]["calls"]]
    assert phases[-5:] == [f"recomputed step {s}" for s in range(5)]  # the cache's check
    out = " ".join(capsys.readouterr().out.split())  # the lines wrapped at 80, joined
    assert "static: 1 1 1 1 1 recompile(s), every step in 1 cell(s)" in out
    assert "recompiles at every call of the model (each new length compiles anew" in out


def test_inductor_reorderings_pass_under_the_tolerance_model(models, tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHPARITY_COMPILER", raising=False)
    status, report = _check(models, tmp_path, "one_block", "--backend", "sdpa", "--compile",
                            "static")
    compiled = [r for r in report["results"] if r["compile"]]
    assert status == 0 and {r["output"] for r in compiled} == {"outputs", "loss", "grads"}
    assert all(r["compiled"]["compiler"] == "inductor" and r["verdict"] in ("within",
                                                                            "identical")
               for r in compiled)


# --- Inductor on the zoo and on transformers models (slow: minutes of compiling) ------------


@pytest.mark.slow
def test_zoo_compiled_cells_pass_in_fp32_and_bf16_and_count_decoding(tmp_path):
    report = tmp_path / "check.json"
    assert main(["check", "--case", "llama-tiny", "--backend", "manual", "--backend", "sdpa",
                 "--compile", "--json", str(report)]) == 0
    rows = [r for r in json.loads(report.read_text())["results"] if r["compile"]]
    assert {(r["backend"], r["dtype"], r["compile"]) for r in rows} == {
        (b, d, f) for b in ("manual", "sdpa") for d in ("fp32", "bf16")
        for f in ("dynamic", "static")}
    for row in rows:
        assert row["compiled"]["compiler"] == "inductor"
        assert row["compiled"]["graph_breaks"] == 0  # the reference models trace whole
        if row["output"] == "decode":
            steps = row["compiled"]["steps"]
            assert all(step["verdict"] in ("within", "identical") for step in steps)
            pattern = [len(step["recompiles"]) for step in steps]
            # dynamic: the prompt (no gradients), the first cached step, the cache's new
            # strides, then no new length recompiles; static: every length does.
            assert pattern == ([1, 1, 1, 0] if row["compile"] == "dynamic" else [1, 1, 1, 1])


@pytest.mark.slow
@pytest.mark.transformers
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_transformers_compiled_cells_pass_and_decode_step_by_step(tmp_path, family):
    pytest.importorskip("transformers")
    from test_user_models import FACTORIES

    spec = f"{compiled_models.write(tmp_path, 'models', FACTORIES)}:{family}"
    golden, report = tmp_path / "golden", tmp_path / "check.json"
    assert main(["golden", "update", "--model", spec, "--golden-dir", str(golden)]) == 0
    assert main(["check", "--model", spec, "--golden-dir", str(golden), "--backend", "sdpa",
                 "--compile", "--json", str(report)]) == 0
    rows = [r for r in json.loads(report.read_text())["results"] if r["compile"]]
    assert len({(r["dtype"], r["compile"]) for r in rows}) == 4
    decode = [r for r in rows if r["output"] == "decode"]
    assert decode and all(r["verdict"] in ("within", "identical") for r in decode)
    for row in decode:
        steps = row["compiled"]["steps"]
        assert len(steps) == 5 and all(step["verdict"] in ("within", "identical") for step in steps)
        if row["compile"] == "static":
            assert all(step["recompiles"] for step in steps)  # each new length


@pytest.mark.slow
def test_a_change_taken_only_under_compile_in_a_zoo_model_fails_only_compiled(tmp_path):
    spec = f"{compiled_models.write(tmp_path, 'zoo_planted', compiled_models.ZOO_MODELS)}"
    golden, report = tmp_path / "golden", tmp_path / "check.json"
    assert main(["golden", "update", "--model", f"{spec}:planted", "--golden-dir",
                 str(golden)]) == 0
    args = ["check", "--model", f"{spec}:planted", "--golden-dir", str(golden), "--backend",
            "sdpa", "--dtype", "fp32", "--json", str(report)]
    assert main(args) == 0
    assert main([*args, "--compile", "dynamic"]) == 1
    failed = {r["compile"] for r in json.loads(report.read_text())["results"] if not r["ok"]}
    assert failed == {"dynamic"}
