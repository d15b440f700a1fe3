"""A model whose math changed (its reference cell diverges from the goldens): every other cell
is judged against this revision's own float64 as well, so a backend or dtype bug planted in
the same run still fails its cell, and every report says which goldens each cell was judged
against."""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from torchparity import backends
from torchparity.cli import main
from torchparity.golden.cells import BOTH_GOLDENS, OWN_FLOAT64
from toy_repo import CHANGES, MODELS

#: The cells of these tests: the reference, the baseline and one sdpa kernel, in fp32.
CELLS = ("--backend", "manual", "--backend", "sdpa-math", "--dtype", "fp32")
#: The planted bug's relative error in the attention's softmax scale: 2**14 fp32 roundings,
#: far beyond what a one-block model's fp32 rounding can reach.
PLANTED = torch.finfo(torch.float32).eps * 2**14


@pytest.fixture
def changed_model(tmp_path: Path) -> Path:
    """models.py with goldens made from it, then its GELU switched to the tanh form."""
    models = tmp_path / "models.py"
    models.write_text(MODELS)
    assert main(["golden", "update", "--golden-dir", str(tmp_path / "golden"),
                 "--model", f"{models}:make"]) == 0
    before, after = CHANGES["real"]
    models.write_text(MODELS.replace(before, after))
    return models


def check(models: Path, *args: str) -> tuple[int, list[dict], ET.Element]:
    folder = models.parent
    status = main(["check", "--model", f"{models}:make", "--golden-dir", str(folder / "golden"),
                   "--json", str(folder / "check.json"), "--junit", str(folder / "check.xml"),
                   *CELLS, *args])
    rows = json.loads((folder / "check.json").read_text())["results"]
    return status, rows, ET.parse(folder / "check.xml").getroot()


def test_a_changed_model_judges_its_cells_against_its_own_float64(changed_model, capsys):
    status, rows, junit = check(changed_model)
    assert status == 1  # the reference cell diverged: the model changed
    reference = [r for r in rows if r["backend"] == "manual" and r["dtype"] == "fp64"]
    assert {r["verdict"] for r in reference} == {"diverged"}
    # A decoding is forced along the stored golden's tokens: judged against those only.
    others = [r for r in rows if r not in reference and r["verdict"] != "n/a"
              and r["output"] != "decode"]
    assert others and all(r["ok"] for r in rows if r not in reference)
    assert {r["judged_against"] for r in others} == {BOTH_GOLDENS}
    assert all(r["stored_goldens"]["verdict"] for r in others)
    assert {r["judged_against"] for r in reference} == {"stored goldens"}
    # Each budget against the stored goldens carries the change, so it is wider than the one
    # against the model's own float64, and the lines under the table name it and why.
    out = " ".join(capsys.readouterr().out.split())
    assert f"judged against {OWN_FLOAT64} outputs (the model changed)" in out
    assert "Against the stored goldens (of the model before its change" in out
    assert "the fp32 baseline carries the model's change" in out
    judged = {case.get("name"): case.find("properties/property[@name='judged against']")
              for case in junit.iter("testcase")}
    assert judged["sdpa-math fp32 cpu outputs"].get("value") == BOTH_GOLDENS


def test_a_backend_bug_beside_a_changed_model_still_fails_its_cell(changed_model, monkeypatch,
                                                                   capsys):
    run_sdpa = backends._run_sdpa

    def wrong_scale(name, call):
        if name == "sdpa-math":
            call = call._replace(scale=(call.scale or call.query.shape[-1] ** -0.5)
                                 * (1 + PLANTED))
        return run_sdpa(name, call)

    monkeypatch.setattr(backends, "_run_sdpa", wrong_scale)
    status, rows, _ = check(changed_model)
    assert status == 1
    failed = {(r["backend"], r["dtype"]) for r in rows if not r["ok"]}
    assert failed == {("manual", "fp64"), ("sdpa-math", "fp32")}
    bugged = [r for r in rows if r["backend"] == "sdpa-math" and r["output"] == "outputs"]
    assert bugged[0]["verdict"] == "diverged" and bugged[0]["judged_against"] == BOTH_GOLDENS
    out = " ".join(capsys.readouterr().out.split())
    assert f"FAIL models.make sdpa-math fp32 cpu outputs (against {OWN_FLOAT64}):" in out
    # Against its own float64 the baseline's budget is the cell's usual one: the planted bug,
    # far beyond fp32 rounding, stands out there whatever the stored goldens' verdict.
    assert bugged[0]["stored_goldens"]["sensitivity"] > bugged[0]["sensitivity"]


def test_a_changed_zoo_case_judges_its_cells_against_its_own_float64(tmp_path, monkeypatch,
                                                                     capsys):
    """The zoo's path: its reference cell runs apart from the other cells' groups, whose
    judgement against today's float64 must still catch a backend bug beside the change."""
    from torchparity.reference import norms

    shipped = Path(__file__).resolve().parents[2] / "golden"
    shutil.copytree(shipped / "llama-tiny", tmp_path / "golden" / "llama-tiny")
    rms_norm = norms.RMSNorm.forward
    # The model's math changes (each norm's output grows by a thousandth) ...
    monkeypatch.setattr(norms.RMSNorm, "forward", lambda self, x: rms_norm(self, x) * 1.001)
    run_sdpa = backends._run_sdpa

    def wrong_scale(name, call):
        if name == "sdpa-math":  # ... and one backend's softmax scale is off as well
            call = call._replace(scale=(call.scale or call.query.shape[-1] ** -0.5)
                                 * (1 + PLANTED))
        return run_sdpa(name, call)

    monkeypatch.setattr(backends, "_run_sdpa", wrong_scale)
    report = tmp_path / "check.json"
    assert main(["check", "--jobs", "1", "--golden-dir", str(tmp_path / "golden"), "--case",
                 "llama-tiny", *CELLS, "--json", str(report)]) == 1
    rows = json.loads(report.read_text())["results"]
    failed = {(r["backend"], r["dtype"]) for r in rows if not r["ok"]}
    assert failed == {("manual", "fp64"), ("sdpa-math", "fp32")}
    judged = {(r["backend"], r["output"]): r for r in rows if r["dtype"] == "fp32"}
    assert {judged["manual", o]["judged_against"] for o in ("logits", "grads")} == {BOTH_GOLDENS}
    bugged = judged["sdpa-math", "logits"]
    assert bugged["verdict"] == "diverged" and bugged["judged_against"] == BOTH_GOLDENS
    assert bugged["stored_goldens"]["sensitivity"] > bugged["sensitivity"]
    # A forced decoding follows the stored goldens' tokens: judged against them only, with a
    # line naming why its budget carries the change.
    assert judged["sdpa-math", "decode"]["judged_against"] == "stored goldens"
    out = " ".join(capsys.readouterr().out.split())
    assert "The other cells are judged against this revision's own float64 outputs" in out
    assert ("llama-tiny fp32 decode: against the stored goldens only (it follows their "
            "tokens), with a budget earned by a baseline that carries the model's change") in out


def test_a_reference_failure_the_other_cells_do_not_judge_leaves_their_goldens_alone():
    """Only the cached decoding diverged (a self-check of the reference cell): the other
    cells' outputs matched in float64, so nothing says their budgets grew."""
    from torchparity.golden.cells import CheckResult
    from torchparity.golden.report import reference_lines

    rows = [CheckResult("m", "manual", "fp64", "cpu", "decode-cache", "forward", "diverged",
                        10.0, ok=False),
            CheckResult("m", "sdpa", "fp32", "cpu", "outputs", "forward", "within", 0.2,
                        ok=True)]
    [line] = reference_lines(rows)
    assert line.startswith("The model's outputs changed: m's reference fp64 cpu cell")
    assert line.endswith("The other cells are judged against the stored goldens as usual: "
                         "none of the outputs they judge diverged in float64.")
