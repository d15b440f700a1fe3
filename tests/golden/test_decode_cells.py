"""check's decode cells on the step protocol: every cell decodes along the golden's tokens, a
failure names the first step that differs, and no cell reads identical while elements differ.

The toy decoder of ``tests/diagnosis/toy_decoders.py`` is checked against goldens made by its
clean revision; the changed revision (the same entry name) writes its cache one slot too far,
which the prompt does not notice and every later step does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchparity.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

TOYS = Path(__file__).parents[1] / "diagnosis" / "toy_decoders.py"


def _revision(folder: Path, attention: str) -> Path:
    folder.mkdir()
    source = TOYS.read_text() + f"\n\ndef toy():\n    return make({attention})\n"
    (folder / "toy.py").write_text(source)
    return folder / "toy.py"


def _check(source: Path, goldens: Path, tmp_path: Path) -> tuple[int, list[dict]]:
    report = tmp_path / "check.json"
    status = main(["check", "--model", f"{source}:toy", "--golden-dir", str(goldens),
                   "--backend", "manual", "--dtype", "fp32", "--json", str(report)])
    return status, json.loads(report.read_text())["results"]


def test_a_changed_decoding_fails_naming_its_first_step(tmp_path: Path, capsys) -> None:
    goldens = tmp_path / "golden"
    base = _revision(tmp_path / "base", "SelfAttention")
    assert main(["golden", "update", "--model", f"{base}:toy", "--golden-dir", str(goldens)]) == 0
    status, rows = _check(base, goldens, tmp_path)
    assert status == 0 and {r["output"] for r in rows} >= {"decode"}

    changed = _revision(tmp_path / "changed", "PreallocatedSelfAttention")
    status, rows = _check(changed, goldens, tmp_path)
    assert status == 1
    failed = [r for r in rows if not r["ok"]]
    assert [(r["backend"], r["dtype"], r["output"]) for r in failed] == [
        ("manual", "fp64", "decode")]
    assert failed[0]["explain"].startswith("first step that differs: 1 (0 is the prompt)")
    # fp32 decodes along the golden's tokens: it repeats its own baseline, and says so
    # without claiming equality with the golden where elements differ.
    for row in rows:
        assert not (row["verdict"] == "identical" and "differ" in (row["explain"] or "")), row
    assert "first step that differs: 1" in capsys.readouterr().out


def test_goldens_made_by_the_older_greedy_generate_are_stale(tmp_path: Path, capsys) -> None:
    goldens = tmp_path / "golden"
    base = _revision(tmp_path / "base", "SelfAttention")
    assert main(["golden", "update", "--model", f"{base}:toy", "--golden-dir", str(goldens)]) == 0
    summary = goldens / "toy.toy" / "decode.json"
    data = json.loads(summary.read_text())
    data.pop("decoding")  # as goldens of greedy generate were written
    summary.write_text(json.dumps(data))
    assert main(["check", "--model", f"{base}:toy", "--golden-dir", str(goldens)]) == 2
    assert "was made by greedy generate, the factory now decodes step by step" in (
        capsys.readouterr().err)
