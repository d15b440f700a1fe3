"""Decoding diagnosis across two ``transformers`` releases: ``record --decode`` under an older
release (another virtualenv, its python named by ``TORCHPARITY_OLD_TRANSFORMERS``, e.g. one
with transformers 4.46.3) and ``diagnose --against`` under this one, same weights
(``hf_releases.py``, plain factories).

Unchanged models decode alike: no step leaves the budget, no flip. With a bug planted in the
cached path of this release's attention: step 1, layer 0's attention, the module's own code (no
argument entry: the cache keyword's rename and the cache class are no difference), real
changes. Slow (two processes, two releases); the logic is covered fast by
``test_diagnose_revisions.py`` on the same layouts.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from torchparity.cli import main

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

FACTORIES = Path(__file__).with_name("hf_releases.py")
OLD = os.environ.get("TORCHPARITY_OLD_TRANSFORMERS")
ATTENTION = {"llama": "model.layers.0.self_attn", "gpt2": "transformer.h.0.attn"}


@pytest.fixture(scope="module", params=sorted(ATTENTION))
def recorded(request, tmp_path_factory) -> tuple[str, Path]:
    if not OLD:
        pytest.skip("set TORCHPARITY_OLD_TRANSFORMERS to the python of a virtualenv with an "
                    "older transformers release and torchparity installed")
    family = request.param
    trace = tmp_path_factory.mktemp("releases") / f"{family}.tptrace"
    subprocess.run([OLD, "-m", "torchparity", "record", f"{FACTORIES}:{family}", "--decode",
                    "--steps", "6", "-o", str(trace)], check=True,
                   env={**os.environ, "TP_PLANT": ""})
    return family, trace


def _diagnosed(recorded: tuple[str, Path], tmp_path: Path, monkeypatch, plant: str) -> dict:
    family, trace = recorded
    monkeypatch.setenv("TP_PLANT", plant)
    out = tmp_path / "report.json"
    main(["diagnose", f"{FACTORIES}:{family}", "--against", str(trace), "--json", str(out)])
    return json.loads(out.read_text())


def test_the_same_model_decodes_alike_under_both_releases(recorded, tmp_path, monkeypatch):
    report = _diagnosed(recorded, tmp_path, monkeypatch, "")["decode"]
    assert report["first_step"] is None and not report["flips"], report["steps"]


def test_a_bug_in_the_cached_path_is_the_attentions_own_code(recorded, tmp_path, monkeypatch):
    report = _diagnosed(recorded, tmp_path, monkeypatch, "1")["decode"]
    assert report["first_step"] == 1
    assert report["first_module"] == f"{ATTENTION[recorded[0]]} @ step 1"
    assert report["entry"]["via"] == "code", report["entry"]
    assert all(flip["verdict"] == "real change" for flip in report["flips"])
