"""``diagnose --compile --bisect`` under Inductor (slow: each bisection compiles the cell 15 to
23 times): the custom post-grad passes and the lowerings planted in tests/bisect_models.py, in
a block calling SDPA and in one writing its attention by hand, are each named at their pass or
op, on the right graph, at the model's line; default Inductor and the zoo's compiled cell come
out clean after one compiled run. Each bisection runs in a process of its own: this one keeps
no bisector state and none of the planted passes or lowerings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bisect_models
from torchparity.cli import main


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return bisect_models.write(tmp_path_factory.mktemp("bisect"))


def _bisect(entry: str, report: Path) -> tuple[int, dict]:
    status = main(["diagnose", entry, "--compile", "static", "--bisect", "--json", str(report)])
    return status, json.loads(report.read_text())


def _left_clean() -> None:
    from torch._inductor import config
    from torch._inductor.compiler_bisector import CompilerBisector
    from torch._inductor.lowering import lowerings

    assert config.post_grad_custom_post_pass is None  # the factory ran in the child only
    assert all(getattr(lower, "__name__", "") != "planted" for lower in lowerings.values())
    assert not CompilerBisector.bisection_enabled and CompilerBisector.in_process_cache is None
    assert CompilerBisector.get_backend() is None  # no bisect_status.txt read back


POST_GRAD = ("post_grad_passes", "post_grad_custom_post_pass")


@pytest.mark.slow
@pytest.mark.parametrize(("plant", "found_as", "graph", "op", "line"), [
    ("mm", POST_GRAD, "forward", "aten.mm.default", "QKV"),
    ("backward_mm", POST_GRAD, "backward", "aten.mm.default", "DOWN"),
    ("gelu", POST_GRAD, "forward", "aten.gelu.default", "GELU"),
    ("hand_mm", POST_GRAD, "forward", "aten.mm.default", "HAND_QKV"),
    ("hand_backward_mm", POST_GRAD, "backward", "aten.mm.default", "HAND_DOWN"),
    ("hand_exp", ("lowerings", "aten.exp.default"), "forward", "aten._softmax.default",
     "SOFTMAX"),
    ("hand_backward_bmm", ("lowerings", "aten.bmm.default"), "backward", "aten.bmm.default",
     "VALUES"),
])
def test_a_planted_pass_or_lowering_is_named_with_its_graph(models, tmp_path, plant,
                                                             found_as, graph, op, line):
    status, report = _bisect(f"{models}:{plant}", tmp_path / "bisect.json")
    assert status == 1 and report["verdict"] == "diverged"
    found = report["bisect"]
    assert (found["backend"], found["subsystem"], found["pass"]) == ("inductor", *found_as)
    assert (found["graph"], found["original_aten"]) == (graph, op)
    assert found["source"].endswith(f"{models.name}:{bisect_models.line_of(models, line)}")
    assert report["compiled"]["runs"] == found["compiles"] <= found["bound"]
    _left_clean()


@pytest.mark.parametrize("plant", [
    pytest.param("clean", marks=pytest.mark.slow),
    "hand_clean",  # attention by hand: no SDPA call, and nothing refused for it
])
def test_default_inductor_is_clean_after_one_compile(models, tmp_path, capsys, plant):
    status, report = _bisect(f"{models}:{plant}", tmp_path / "bisect.json")
    assert status == 0 and (report["verdict"], report["bisect"]) == ("within", None)
    # One compiled run of the cell, whose one training call compiles one graph (its forward
    # and backward) and never recompiles.
    compiled = report["compiled"]
    assert (compiled["runs"], compiled["graphs"], compiled["recompiles"]) == (1, 1, 0)
    out = capsys.readouterr().out
    assert "nothing to bisect (1 compiled run of the cell: 1 graph, 0 recompiles" in " ".join(
        out.split()) and "run 2" not in out
    _left_clean()


@pytest.mark.slow
def test_the_zoo_compiled_cell_passes_without_bisecting(tmp_path, capsys):
    status, report = _bisect("llama-tiny", tmp_path / "bisect.json")
    assert status == 0 and report["bisect"] is None
    assert "run 2" not in capsys.readouterr().out


@pytest.mark.slow
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
