"""A transformers model is judged as built: its goldens run the attention implementation it was
built with, and the library's other implementations are alternatives judged against it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchparity.cli import main
from torchparity.golden.store import GoldenStore

pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers

MODELS = Path(__file__).with_name("built_attention_models.py")


@pytest.fixture(scope="module")
def goldens(tmp_path_factory):
    folder = tmp_path_factory.mktemp("built")
    assert main(["golden", "update", "--model", f"{MODELS}:capped",
                 "--golden-dir", str(folder)]) == 0
    return folder


def _logits(model_fn, dtype=torch.float64):
    model, inputs = model_fn()
    model = model.to(dtype)
    with torch.no_grad():
        return model(**inputs).logits


def test_the_goldens_are_of_the_implementation_the_model_was_built_with(goldens):
    import built_attention_models as built

    golden = GoldenStore(goldens).read("built_attention_models.capped", "outputs")
    stored = golden.tensors["output.logits"].double()
    capped, sdpa = _logits(built.capped), _logits(built.sdpa)
    # Plain float64 runs of the two paths: the golden is the capped one, far from sdpa's.
    assert (stored - capped).abs().max() < 1e-3 * (stored - sdpa).abs().max()


def test_the_other_implementations_fail_and_are_named(goldens, tmp_path, capsys):
    report = tmp_path / "check.json"
    status = main(["check", "--model", f"{MODELS}:capped", "--golden-dir", str(goldens),
                   "--backend", "manual", "--backend", "sdpa", "--backend", "hf-eager",
                   "--dtype", "fp32", "--jobs", "1", "--json", str(report)])
    rows = json.loads(report.read_text())["results"]
    assert status == 1
    failed = {r["backend"] for r in rows if not r["ok"]}
    assert failed == {"sdpa", "hf-eager"}, [r["explain"] for r in rows if not r["ok"]]
    assert all(r["ok"] for r in rows if r["backend"] == "manual")
    out = capsys.readouterr().out
    assert "the library's sdpa implementation, the goldens its capped one" in " ".join(
        out.split())
