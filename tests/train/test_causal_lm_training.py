"""Training parity of a ``transformers`` causal LM by the default recipe of
:mod:`torchparity.train.causal_lm` (``hf_lm.py``: a tiny Llama whose factory returns the model
alone). The unchanged model must stay within its band; RoPE's base frequency changed must
part at step 1's loss (the forward pass of the first step); the norms moved into the decay
group must be named as the cause. The no-decay list is the one transformers' Trainer makes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchparity.cli import main

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.transformers

ENTRY = f"{Path(__file__).parent / 'hf_lm.py'}:lm"
STEPS = "4"


def train_cli(*args: str) -> int:
    return main(["train", "--model", ENTRY, "--steps", STEPS, *args])


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """The original's golden trajectory and fp32 band, made by the command."""
    folder = tmp_path_factory.mktemp("goldens")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_LM_VARIANT", "base")
        assert train_cli("--update-golden", "--golden-dir", str(folder)) == 0
    return folder


@pytest.mark.parametrize("variant, status, first", [
    ("base", 0, None),
    ("rope_theta", 1, {"step": 1, "quantity": "loss"}),
])
def test_the_unchanged_model_is_within_and_a_changed_rope_parts_at_step_1(
        golden, monkeypatch, tmp_path, variant, status, first):
    monkeypatch.setenv("HF_LM_VARIANT", variant)
    out = tmp_path / "verdict.json"
    assert train_cli("--check", "--golden-dir", str(golden), "--json", str(out)) == status
    comparison = json.loads(out.read_text())["comparison"]
    assert comparison["first_divergence"] == first
    # the default recipe's two groups are judged, each on its own
    assert {"grad_norm[decay]", "update_norm[no_decay]"} <= set(
        comparison["headroom_by_quantity"])


def test_the_norms_moved_into_the_decay_group_are_named(golden, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_LM_VARIANT", "norms_decay")
    out = tmp_path / "verdict.json"
    assert train_cli("--check", "--diagnose", "--golden-dir", str(golden),
                     "--json", str(out)) == 1
    causes = json.loads(out.read_text())["diagnosis"]["causes"]
    norms = [f"model.layers.{i}.{n}_layernorm.weight" for i in range(2)
             for n in ("input", "post_attention")]
    assert causes == [f"5 parameters moved from group no_decay to decay: "
                      f"{', '.join([*norms, 'model.norm.weight'])}"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_no_decay_list_is_the_trainers(family):
    from transformers import Trainer

    from torchparity.subject.hf_families import tiny_model
    from torchparity.train.causal_lm import decay_parameter_names

    model = tiny_model(family)
    assert decay_parameter_names(model) == set(Trainer.get_decay_parameter_names(None, model))


def test_a_frozen_parameter_is_not_optimised_by_the_recipe_and_gets_no_gradient_hook(
        monkeypatch, tmp_path):
    from torchparity.train.causal_lm import optimizer
    from train.hf_lm import build

    model = build("base")
    model.model.norm.weight.requires_grad_(False)
    optimised = [p for group in optimizer(model).param_groups for p in group["params"]]
    assert len(optimised) == sum(p.requires_grad for p in model.parameters())
    assert all(p is not model.model.norm.weight for p in optimised)
    # a user's optimizer may list it: training runs, its gradient hooks skip it
    monkeypatch.setenv("HF_LM_VARIANT", "frozen")
    assert train_cli("--update-golden", "--golden-dir", str(tmp_path)) == 0
