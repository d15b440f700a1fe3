"""``transformers`` models are recognised and switched between their attention implementations
on every release supported (``tox -e hf-lowest`` runs these under the oldest): a model in
``eager`` makes no SDPA call, one in ``sdpa`` one per layer, and both compute what the float64
model does; a plain factory decodes through the built-in step and gets its ``hf-eager`` cells."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import tiny_transformers  # skips the module where transformers is not installed
import torchparity as tp
from torchparity import backends
from torchparity.cli import main
from torchparity.golden.model_runs import HF_EAGER
from torchparity.subject import hf

pytestmark = pytest.mark.transformers


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_transformers_models_are_recognised_and_only_generators_generate(family: str) -> None:
    model = tiny_transformers.FAMILIES[family][0]()
    assert hf.is_transformers(model)
    assert hf.generates(model) == (family != "bert")
    assert not hf.is_transformers(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("built_with", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_attention_switches_both_ways_whatever_the_model_was_built_with(
        family: str, built_with: str) -> None:
    torch.manual_seed(0)
    model = tiny_transformers.FAMILIES[family][0](attn_implementation=built_with).eval()
    golden = copy.deepcopy(model).double()
    ids = torch.randint(0, tiny_transformers.VOCAB, (2, 6),
                        generator=torch.Generator().manual_seed(0))
    logits, calls = [], []
    with torch.no_grad():
        expected = golden(input_ids=ids).logits
        for implementation in (hf.EAGER, hf.SDPA, hf.EAGER):
            hf.set_attention(model, implementation)
            with backends.use("manual") as intercepted:
                logits.append(model(input_ids=ids).logits)
            calls.append(intercepted.calls)
    assert calls == [0, tiny_transformers.LAYERS, 0]
    assert torch.equal(logits[0], logits[2])  # switched back, it computes as before
    tp.assert_parity(logits[1], expected, baseline=logits[0], kind="forward")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_plain_factory_gets_the_built_in_step_a_decode_golden_and_hf_eager(family, tmp_path):
    entry = f"{Path(__file__).parents[1] / 'cross_release_models.py'}:{family}"
    golden, report = tmp_path / "golden", tmp_path / "check.json"
    assert main(["golden", "update", "--model", entry, "--golden-dir", str(golden)]) == 0
    assert main(["check", "--model", entry, "--golden-dir", str(golden), "--backend",
                 "hf-eager", "--dtype", "fp32", "--json", str(report)]) == 0
    rows = json.loads(report.read_text())["results"]
    eager = {r["output"]: r["verdict"] for r in rows if r["backend"] == HF_EAGER}
    assert set(eager) == {"outputs", "loss", "grads", "decode"}
    assert set(eager.values()) <= {"identical", "within"}
    reference = {r["output"]: r["verdict"] for r in rows if r["backend"] == "manual"}
    assert {"decode", "decode-cache"} <= set(reference)
