"""eole's own tensor-parallel ``MLP`` (tests/eole_tp_models.py) checked across 2 ranks against
goldens of one process, and diagnosed against a trace of one process. Its forward reduces
the ranks' partial sums; its backward passes the reduced gradient through but never sums the
gradient of the MLP's input across the ranks (eole runs tensor parallel for inference): each
rank's gradients above the first MLP hold its own columns' share only. The forward must be
within its budget, the gradients must not, and the first to diverge, in backward order, is
the last norm's that feeds an MLP. Skipped where eole is not installed (it needs a torch of
its own range: install it in a separate environment)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchparity.cli import main

pytest.importorskip("eole.modules.transformer_mlp")

MODELS = Path(__file__).resolve().parents[1] / "eole_tp_models.py"
ENTRY = f"{MODELS}:eole_mlp_tp"


@pytest.mark.slow
def test_eole_s_tensor_parallel_mlp_runs_forward_as_one_process_and_loses_input_gradients(
        tmp_path, capsys):
    golden = ["--golden-dir", str(tmp_path / "golden")]
    assert main(["golden", "update", "--model", ENTRY, *golden]) == 0
    report = tmp_path / "check.json"
    assert main(["check", "--model", ENTRY, "--nproc", "2", "--backend", "manual",
                 "--dtype", "fp32", *golden, "--json", str(report)]) == 1
    rows = json.loads(report.read_text())["results"]
    reference = {r["output"]: r["verdict"] for r in rows if r["dtype"] == "fp64"}
    assert reference == {"outputs": "within", "loss": "within", "grads": "diverged"}
    trace = tmp_path / "eole.tptrace"
    assert main(["record", ENTRY, "-o", str(trace)]) == 0
    diagnosis = tmp_path / "diagnosis.json"
    assert main(["diagnose", ENTRY, "--nproc", "2", "--against", str(trace),
                 "--json", str(diagnosis)]) == 1
    found = json.loads(diagnosis.read_text())
    assert found["first_divergence"] is None
    grad = found["first_grad_divergence"]
    assert (grad["module"], grad["ranks"], grad["result"]["verdict"]) == (
        "norms.1", [0, 1], "diverged")
