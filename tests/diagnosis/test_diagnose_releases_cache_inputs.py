"""Layers handed a cache, across two ``transformers`` releases: ``record`` under an older
release (the python named by ``TORCHPARITY_OLD_TRANSFORMERS``, e.g. a virtualenv with
transformers 4.46.3, whose ``DynamicCache`` keeps ``key_cache`` lists) and ``diagnose
--against`` under this one (whose ``DynamicCache`` keeps ``layers``), same weights
(``hf_releases.py``). The recorded caches are rebuilt as this release's class from their
keys and values, so every layer replays, and a mask changed inside layer 1 is named as the
argument through which the change enters. Slow (two processes, two releases); the same-release
case is ``test_diagnose_cache_inputs.py``."""

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


# Llama only: 4.46's Mistral computes its rotary table inside each attention, 5.x's once
# for the model, so its layers take other arguments across the two releases.
@pytest.fixture(scope="module", params=["llama_cached"])
def recorded(request, tmp_path_factory) -> tuple[str, Path]:
    if not OLD:
        pytest.skip("set TORCHPARITY_OLD_TRANSFORMERS to the python of a virtualenv with an "
                    "older transformers release and torchparity installed")
    trace = tmp_path_factory.mktemp("releases") / f"{request.param}.tptrace"
    subprocess.run([OLD, "-m", "torchparity", "record", f"{FACTORIES}:{request.param}",
                    "--no-backward", "-o", str(trace)], check=True,
                   env={**os.environ, "TP_PLANT": ""})
    return request.param, trace


def test_a_mask_changed_inside_a_layer_enters_through_its_attention(recorded, tmp_path,
                                                                    monkeypatch):
    factory, trace = recorded
    monkeypatch.setenv("TP_PLANT", "mask")
    out = tmp_path / "report.json"
    main(["diagnose", f"{FACTORIES}:{factory}", "--against", str(trace), "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["first_divergence"]["module"] == "model.layers.1", report["first_divergence"]
    entry = next(row for row in report["rows"] if row["module"] == "model.layers.1")["entry"]
    assert (entry["module"], entry["argument"]) == ("model.layers.1.self_attn",
                                                    "attention_mask"), entry
    notes = [note for row in report["rows"] for note in row["notes"]]
    assert not any("not replayable" in note for note in notes), notes
