"""A mask handed in another convention is no evidence against the module it is replayed into.

A hands each attention its padding mask and builds the causal mask inside; B hands None and
asks SDPA for ``is_causal=True`` (``convention_models.py``; in transformers, SDPA's
``attention_mask=None`` against eager's float mask). B's attention fed A's mask attends to
later keys: its replay diverges although B's own run is within budget. Such a module is
judged by B's own run, or replayed with the argument as B passes it, and the search goes on
to the module whose own arithmetic changed. Families: a toy decoder, Llama and Mistral.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from convention_models import inputs, pair

import torchparity as tp

pytestmark = pytest.mark.usefixtures("single_thread")

CONVENTION = "arguments in another convention: attention_mask: A passes Tensor(2, 1, 1, 8) " \
             "bool, B passes None"


def _notes(report, module: str) -> str:
    return " ".join(report.row(module).notes)


def test_the_first_divergence_is_the_layer_whose_arithmetic_changed() -> None:
    a, b = pair(changed_layer=1)
    report = tp.diagnose(a, b, inputs())
    text = report.render()
    first = report.first_divergence
    assert first.module == "layers.1.mlp", text
    answer = first.ops.to_dict()
    assert answer["name"] == "aten::gelu", answer
    assert "convention_models.py" in answer["a_stack"][0], answer
    assert "convention_models.py" in answer["b_stack"][0], answer
    assert "F.gelu" in answer["code"]["a"] and "F.gelu" in answer["code"]["b"], answer
    for module in ("layers.0.attn", "layers.0", "layers.1.attn"):
        assert report.row(module).local.ok, text
        assert CONVENTION in _notes(report, module), text
    # Past the change, the layers are replayed with the mask as B passes it: they add
    # nothing of their own to what they inherit.
    for module in ("layers.2.attn", "layers.2"):
        assert report.row(module).local.ok, text
        assert "replayed on A's arguments with attention_mask as B passes it (None)" in \
            _notes(report, module), text


def test_a_convention_change_alone_comes_out_clean() -> None:
    a, b = pair(changed_layer=None)
    report = tp.diagnose(a, b, inputs(), local="all")
    text = report.render()
    assert report.first_divergence is None and report.first_grad_divergence is None, text
    assert report.output.ok, text
    assert CONVENTION in _notes(report, "layers.0.attn"), text


def test_the_replay_as_recorded_is_what_blamed_the_attention() -> None:
    """The fault this guards against: B's attention on A's padding mask, alone, is far out of
    its budget (it attends to later keys), so a verdict from that replay would blame it."""
    a, b = pair(changed_layer=None)
    mask = inputs()["attention_mask"].bool()[:, None, None, :]
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        golden = copy.deepcopy(b.layers[0].attn).double()(x.double(), None)
        own = b.layers[0].attn(x, None)
        fed_a_mask = b.layers[0].attn(x, mask)
        a_own = a.layers[0].attn(x, mask)
    # B's own float32 run earns the budget: A's attention on its own mask is within it
    assert tp.compare(a_own, golden, own).ok
    assert tp.compare(fed_a_mask, golden, own).verdict == "diverged"


def _hf(family: str, attention: str, changed: bool) -> torch.nn.Module:
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[family]
    config = config_class(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    config._attn_implementation = attention
    model = tp.init_weights(model_class(config), seed=0).eval()
    if changed:
        model.model.layers[1].mlp.act_fn = torch.nn.GELU(approximate="tanh")
    return model


@pytest.mark.transformers
@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("changed", [True, False], ids=["changed", "control"])
def test_sdpa_against_eager_is_judged_by_bs_own_run(family: str, changed: bool) -> None:
    """A on SDPA hands its attention None (``is_causal``), B on eager a float causal mask:
    every module is replayed (``local='all'``), the attentions are judged by B's own run, and
    the first divergence is the activation B changed, or none."""
    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    report = tp.diagnose(_hf(family, "sdpa", False), _hf(family, "eager", changed),
                         {"input_ids": ids}, backward=False, local="all")
    text = report.render()
    first = report.first_divergence
    assert (first.module if first else None) == (
        "model.layers.1.mlp.act_fn" if changed else None), text
    attention = report.row("model.layers.0.self_attn")
    assert attention.local.ok, text
    assert "arguments in another convention: attention_mask: A passes None, B passes " \
           "Tensor(2, 1, 8, 8) float32" in " ".join(attention.notes), text
