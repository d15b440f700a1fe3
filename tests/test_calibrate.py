"""The calibration command: a few draws run, catch a planted bug and pass a legitimate backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchparity.calibration.problems import BUGS, Variant, draw_problem, run_block
from torchparity.calibration.report import render_markdown
from torchparity.calibration.study import calibrate
from torchparity.cli import main
from torchparity.comparison import compare

SMALL_SEED = 7  # a 2x4x18x128 causal problem: cheap, several heads, a mask to leak through


@pytest.fixture(scope="module")
def outputs() -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    problem = draw_problem(SMALL_SEED)
    assert problem.heads > 1 and problem.seq < 64
    return {
        "golden": run_block(problem, torch.float64),
        "baseline": run_block(problem, torch.float32),
        "sdpa": run_block(problem, torch.float32, Variant(backend="sdpa")),
        "dropped": run_block(problem, torch.float32, BUGS["one head dropped"]),
    }


@pytest.mark.parametrize("kind", ["forward", "grad"])
def test_a_legitimate_backend_passes(outputs: dict, kind: str) -> None:
    result = compare(
        outputs["sdpa"][kind], outputs["golden"][kind], outputs["baseline"][kind], kind
    )
    assert result.ok, result.explain()


@pytest.mark.parametrize("kind", ["forward", "grad"])
def test_a_dropped_head_is_detected(outputs: dict, kind: str) -> None:
    golden, baseline = outputs["golden"][kind], outputs["baseline"][kind]
    result = compare(outputs["dropped"][kind], golden, baseline, kind)
    assert result.verdict == "diverged"


def test_draws_are_reproducible() -> None:
    a, b = draw_problem(3), draw_problem(3)
    assert a.shape == b.shape and all(torch.equal(a.tensors[n], b.tensors[n]) for n in a.tensors)


def test_a_short_calibration_finds_no_false_alarm_and_catches_visible_bugs() -> None:
    results = calibrate(2, seed=SMALL_SEED, dtypes=["fp32"], backend_names=["sdpa"])
    assert results.n_false_alarms == 0
    assert results.detection_goal_met()
    dropped = results.detection[("one head dropped", "fp32", "forward")]
    assert dropped.applicable == dropped.visible == dropped.caught_visible > 0
    report = render_markdown(results, command="torchparity calibrate --draws 2")
    assert "| sdpa | fp32 | forward | 2 | 0 |" in report
    assert "| one head dropped | fp32 | forward |" in report


def test_the_detection_curve_counts_each_size_of_the_sized_change() -> None:
    results = calibrate(1, seed=SMALL_SEED, dtypes=["fp32"], backend_names=["sdpa"])
    sized = results.curve[("fp32", "forward", "sized scale")]
    # The change is planted at 1, 2, ... 32 times the baseline's forward error: its measured
    # effect reaches each multiple about once, and the largest sizes are caught.
    assert 5 <= sized.counts[1][0] <= 6 and sized.counts[32][0] <= 2
    assert sized.counts[16][1] == sized.counts[16][0] > 0
    report = render_markdown(results, command="torchparity calibrate --draws 1")
    assert "## Detection against the size of the change" in report
    assert "| fp32 | forward | sized scale |" in report


def test_the_command_writes_json_and_rejects_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "calibration.json"
    argv = ["calibrate", "--draws", "1", "--seed", str(SMALL_SEED), "--dtype", "fp32"]
    assert main([*argv, "--backend", "sdpa-math", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {row["backend"] for row in data["false_alarms"]} == {"sdpa-math"}
    assert {row["changes"] for row in data["detection_curve"]} == {"all bugs", "sized scale"}
    assert main(["calibrate", "--draws", "0"]) == 2
    assert "--draws must be at least 1" in capsys.readouterr().err
