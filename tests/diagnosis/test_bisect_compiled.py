"""``diagnose --compile --bisect`` under Inductor (slow: each bisection compiles the cell about
15 times): the custom post-grad passes planted in tests/bisect_models.py are each named at
their pass, on the right graph, the GELU at the model's line; default Inductor and the zoo's
compiled cell come out clean with no bisection run. Each bisection runs in a process of its
own: this one keeps no bisector state and none of the planted passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bisect_models
from torchparity.cli import main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return bisect_models.write(tmp_path_factory.mktemp("bisect"))


def _bisect(entry: str, report: Path) -> tuple[int, dict]:
    status = main(["diagnose", entry, "--compile", "static", "--bisect", "--json", str(report)])
    return status, json.loads(report.read_text())


def _left_clean() -> None:
    from torch._inductor import config
    from torch._inductor.compiler_bisector import CompilerBisector

    assert config.post_grad_custom_post_pass is None  # the factory ran in the child only
    assert not CompilerBisector.bisection_enabled and CompilerBisector.in_process_cache is None
    assert CompilerBisector.get_backend() is None  # no bisect_status.txt read back


@pytest.mark.parametrize(("plant", "graph", "op", "line"), [
    ("mm", "forward", "aten.mm.default", "QKV"),
    ("backward_mm", "backward", "aten.mm.default", "DOWN"),
    ("gelu", "forward", "aten.gelu.default", "GELU"),
])
def test_a_planted_pass_is_named_with_its_graph(models, tmp_path, plant, graph, op, line):
    status, report = _bisect(f"{models}:{plant}", tmp_path / "bisect.json")
    assert status == 1 and report["verdict"] == "diverged"
    found = report["bisect"]
    assert (found["backend"], found["subsystem"], found["pass"]) == (
        "inductor", "post_grad_passes", "post_grad_custom_post_pass")
    assert (found["graph"], found["original_aten"]) == (graph, op)
    assert found["source"].endswith(f"{models.name}:{bisect_models.line_of(models, line)}")
    assert found["compiles"] <= found["bound"]
    _left_clean()


def test_default_inductor_is_clean_without_bisecting(models, tmp_path, capsys):
    status, report = _bisect(f"{models}:clean", tmp_path / "bisect.json")
    assert status == 0 and report == {"cell": report["cell"], "verdict": "within",
                                      "bisect": None}
    out = capsys.readouterr().out
    assert "nothing to bisect" in out and "run 2" not in out  # one compiled run, no more
    _left_clean()


def test_the_zoo_compiled_cell_passes_without_bisecting(tmp_path, capsys):
    status, report = _bisect("llama-tiny", tmp_path / "bisect.json")
    assert status == 0 and report["bisect"] is None
    assert "run 2" not in capsys.readouterr().out


@pytest.mark.gpu
def test_a_planted_pass_is_bisected_on_cuda(models, tmp_path, capsys):
    # CUDA kernels need not be deterministic: each verdict is run three times and must agree.
    status = main(["diagnose", f"{models}:mm", "--compile", "static", "--bisect", "--device",
                   "cuda", "--json", str(tmp_path / "bisect.json")])
    found = json.loads((tmp_path / "bisect.json").read_text())["bisect"]
    assert status == 1 and "cuda compiled static" in capsys.readouterr().out
    assert (found["subsystem"], found["pass"], found["graph"], found["original_aten"]) == (
        "post_grad_passes", "post_grad_custom_post_pass", "forward", "aten.mm.default")
    assert found["source"].endswith(f"{models.name}:{bisect_models.line_of(models, 'QKV')}")
    _left_clean()
