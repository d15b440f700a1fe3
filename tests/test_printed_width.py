"""What torchparity prints reads whole in a CI log: no line wider than 80 columns, no name or
note cut, repeated notes said once, and every footnote and legend complete.

``check`` (zoo and ``--model``), ``diagnose`` and ``diagnose --decode`` run here as a user runs
them, their output captured as a pipe captures it (no terminal, so no width of its own).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import toy_repo
from torchparity.cli import main
from torchparity.golden.cells import CheckResult
from torchparity.golden.report import COARSE, sensitivity_lines

SHIPPED = Path(__file__).resolve().parents[1] / "golden"
WIDTH = 80

pytestmark = pytest.mark.usefixtures("single_thread")


def printed(capsys, argv: list[str]) -> tuple[int, list[str]]:
    status = main(argv)
    return status, capsys.readouterr().out.splitlines()


def assert_fits(lines: list[str]) -> None:
    wide = [line for line in lines if len(line) > WIDTH]
    assert not wide, wide


def flat(lines: list[str]) -> str:
    """The output as one line of words: what a reader gets once the wrapping is undone."""
    return " ".join(" ".join(lines).split())


def test_the_zoo_check_fits_80_columns_and_says_every_note_whole(tmp_path, capsys):
    report = tmp_path / "check.json"
    status, lines = printed(capsys, [
        "check", "--jobs", "1", "--golden-dir", str(SHIPPED), "--json", str(report),
        "--case", "encdec-relative", "--case", "llama-tiny", "--backend", "sdpa-flash",
        "--dtype", "fp32", "--dtype", "bf16"])
    assert status == 0
    assert_fits(lines)
    text = flat(lines)
    results = json.loads(report.read_text())["results"]
    # Every reason, padding note and name is printed whole, however the lines wrap.
    for r in results:
        assert r["case"] in text
        if r["verdict"] == "n/a":
            assert r["reason"] in text
            assert not r["reason"].endswith(":")  # a reason that names no reason is no reason
    notes = {(r["output"], r["left_out"].removeprefix("Left out of the judgement: "))
             for r in results if r["left_out"]}
    for output, note in notes:
        assert text.count(f"{output}: {note}") == 1  # once, for every case it holds for
    assert "unknown machine" not in text
    assert "torchparity check: each cell's verdict and the most of its budget used" in lines
    assert "≡ bit-identical to the baseline, ✓ within its budget, ✗ diverged" in text
    # The shipped goldens name their machine: a line says so where it is not this one.
    assert "do not record" not in text
    assert text.startswith(("goldens made on cpu ", "torchparity check:"))


def test_a_coarse_sensitivity_is_marked_and_explained():
    """A sensitivity of 13 means a change of 13 times the output's scale would pass: it is
    named coarse, with what that means, never shown bare."""
    def result(dtype: str, kind: str, sensitivity: float) -> CheckResult:
        return CheckResult(case="m", backend="sdpa", dtype=dtype, device="cpu",
                           output=kind, kind=kind, verdict="within", headroom=0.2, ok=True,
                           sensitivity=sensitivity)

    coarse = 13 * COARSE
    lines = sensitivity_lines([result("bf16", "grad", coarse), result("fp32", "grad", 2e-5)])
    text = flat(lines)
    assert "bf16 grad 13 (coarse)" in text and "fp32 grad 2e-05" in text
    assert "even a change as large as the output itself could have passed" in text
    assert "would have been flagged" in text  # what the numbers are, before them
    fine = flat(sensitivity_lines([result("fp32", "grad", 2e-5)]))
    assert "coarse" not in fine


@pytest.fixture
def toy_models(tmp_path, monkeypatch) -> Path:
    """The toy repository's model as ``a.py`` and its real change as ``b.py``."""
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "a.py").write_text(toy_repo.MODELS)
    before, after = toy_repo.CHANGES["real"]
    (folder / "b.py").write_text(toy_repo.MODELS.replace(before, after))
    monkeypatch.chdir(folder)
    return folder


def test_check_of_a_model_fits_80_columns(toy_models, capsys):
    assert main(["golden", "update", "--model", "a.py:make", "--golden-dir", "g"]) == 0
    status, lines = printed(capsys, ["check", "--jobs", "1", "--model", "a.py:make",
                                     "--golden-dir", "g", "--backend", "sdpa",
                                     "--dtype", "fp32"])
    assert status == 0
    assert_fits(lines)
    assert "a.make" in flat(lines)


@pytest.mark.parametrize("decode", [False, True], ids=["forward", "decode"])
def test_diagnose_fits_80_columns_and_cuts_no_module_name(toy_models, capsys, decode):
    report = toy_models / "d.json"
    status, lines = printed(capsys, ["diagnose", "a.py:make", "b.py:make", "--json",
                                     str(report), *(["--decode"] if decode else [])])
    assert status == 1  # the GELU changed
    assert_fits(lines)
    words = set(flat(lines).split())
    written = json.loads(report.read_text())
    rows = written["decode"]["rows"] if decode else written["rows"]
    names = {row["module"] for row in rows if row.get("module")}
    assert names and names <= words  # every module's name stands whole on a line
    assert re.search(r"\bmlp\b", flat(lines))


@pytest.mark.transformers
def test_diagnose_of_an_installed_packages_model_fits_80_columns(capsys):
    """GPT-2's op rows name transformers' files from the package's folder, each whole."""
    plants = Path(__file__).parent / "diagnosis" / "gpt2_plants.py"
    status, lines = printed(capsys, ["diagnose", f"{plants}:gpt2_a", f"{plants}:gpt2_b_unscaled",
                                     "--no-backward"])
    assert status == 1
    assert_fits(lines)
    package = re.compile(r"^transformers/models/gpt2/modeling_gpt2\.py:\d+$")
    assert any(package.match(word) for word in flat(lines).split()), lines
