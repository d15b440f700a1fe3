"""The sketched study: grown draws judged full and sketched find no false alarm, the estimates
stay within the stated spread, the planted bugs are caught, and its section of
docs/tolerance.md (and the training study's) survives the main study's rewrite. (A sketch of
512 coordinates and a small threshold keep the draws cheap; the study itself runs at the
table's size.)"""

from __future__ import annotations

import dataclasses
import math

import pytest

from torchparity import tolerance
from torchparity.calibration import sketched, training_report
from torchparity.calibration.problems import draw_problem
from torchparity.cli import main

SMALL_SEED = 7


@pytest.fixture
def small_sketches(monkeypatch):
    monkeypatch.setattr(tolerance, "SKETCH", dataclasses.replace(
        tolerance.SKETCH, size=512, min_elements=4096, slice_elements=64))


def test_a_grown_draw_keeps_its_weights_and_reaches_the_sketched_size(small_sketches):
    problem = draw_problem(SMALL_SEED)
    grown = sketched.grown(problem)
    assert grown.batch % problem.batch == 0 and grown.tensors["wq"] is problem.tensors["wq"]
    assert grown.batch * grown.heads * grown.seq * grown.head_dim >= sketched.GROWTH * 512


def test_sketched_study_finds_no_false_alarm_and_catches_the_big_changes(small_sketches):
    results = sketched.calibrate_sketched(1, seed=SMALL_SEED, dtypes=("fp32",))
    assert results.false_alarms == 0
    assert results.spread and max(results.spread) < tolerance.SKETCH.confidence
    for (family, dtype, _), counts in results.detection.items():
        changes, full, caught = counts.counts[32]
        if dtype == "fp32" and family == "all bugs":
            assert changes > 0 and caught == changes  # 32 times the noise: every one
    section = sketched.sketched_section(results, command="torchparity calibrate --sketched")
    assert section.startswith(sketched.BEGIN) and section.rstrip().endswith(sketched.END)
    assert "False alarms" in section and "| fp32 | grad |" in section


def test_the_main_report_keeps_the_sketched_section(tmp_path, small_sketches):
    out = tmp_path / "tolerance.md"
    section = f"{sketched.BEGIN}\n## Sketched goldens\nFIRST-RUN\n{sketched.END}\n"
    training = f"{training_report.BEGIN}\n## Training\nTRAINED\n{training_report.END}\n"
    out.write_text("# old report\n\n" + section + "\n" + training)
    assert main(["calibrate", "--draws", "1", "--seed", str(SMALL_SEED), "--dtype", "fp32",
                 "--backend", "sdpa", "--out", str(out)]) == 0
    text = out.read_text()
    assert "# old report" not in text and text.count(sketched.BEGIN) == 1
    assert sketched.section_of(text) == section
    assert training_report.SECTION.of(text) == training
    again = sketched.merged(text, section.replace("FIRST-RUN", "SECOND-RUN"))
    assert "FIRST-RUN" not in again and again.count("SECOND-RUN") == 1


def test_margin_grows_as_the_sketch_shrinks():
    assert tolerance.sketch_margin(8192) < tolerance.sketch_margin(512) < 2
    assert math.isclose(tolerance.sketch_spread(8192), 1 / 128)
    with pytest.raises(ValueError, match="too small"):
        tolerance.sketch_margin(16)
