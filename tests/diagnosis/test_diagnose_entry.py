"""Where a divergence enters: masks and positions built once by a stack and handed down.

Each plant changes what a reference model's ``Stack`` computes for its layers (a sliding-window
mask off by one, positions off by one under padding, a dropped cross-attention mask), through a
subclass in the test. The stack is then the first module whose local error breaks its budget;
the expectation, known from the reference code independently of the diagnosis, is the first
module inside it that receives the changed value and the argument that carries it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

import torchparity as tp
from torchparity.reference import build_model, models, sequence_loss, zoo

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

_mask = models.self_attention_mask


def _window_off_by_one(key_mask, new, past, *, causal, window):
    return _mask(key_mask, new, past, causal=causal, window=None if window is None else window + 1)


def _positions_off_by_one(mask, batch, length, device):
    if mask is None:
        return torch.arange(length, device=device).expand(batch, length)
    return mask.long().cumsum(-1).clamp(min=0)  # forgot the -1 for masked inputs


class WindowOffByOne(models.Stack):
    def forward(self, *args, **kwargs):
        with mock.patch.object(models, "self_attention_mask", _window_off_by_one):
            return super().forward(*args, **kwargs)


class PositionsOffByOne(models.Stack):
    def forward(self, *args, **kwargs):
        with mock.patch.object(models, "token_positions", _positions_off_by_one):
            return super().forward(*args, **kwargs)


class DropsMemoryMask(models.Stack):
    def forward(self, ids, mask=None, *, memory_mask=None, **kwargs):
        return super().forward(ids, mask, memory_mask=None, **kwargs)


def plant(cls: type) -> Callable[[nn.Module], None]:
    def apply(model: nn.Module) -> None:
        model.decoder.__class__ = cls
    return apply


# case, padding, plant, (entry module, argument, detail fragment)
PLANTS = {
    "sliding-window": ("sliding-window", "none", plant(WindowOffByOne),
                       ("decoder.layers.0.attn", "ctx.mask",
                        "pairs of judged queries attend otherwise")),
    "positions": ("mqa", "left", plant(PositionsOffByOne),
                  ("decoder.embed.positions", "positions", "entries differ")),
    "cross-mask": ("encdec-prenorm", "right", plant(DropsMemoryMask),
                   ("decoder.layers.0.cross_attn", "ctx.mask", "B has None")),
}


def models_for(name: str) -> tuple[nn.Module, nn.Module, dict]:
    case, padding, apply, _ = PLANTS[name]
    cfg = zoo.get(case).config
    model_a = build_model(cfg, seed=0)
    model_b = copy.deepcopy(model_a)
    apply(model_b)
    return model_a, model_b, zoo.make_batch(cfg, batch_size=2, seq_len=10, seed=0,
                                            padding=padding)


def assert_entry(report: tp.DiagnosisReport, name: str) -> None:
    module, argument, detail = PLANTS[name][3]
    first = report.first_divergence
    assert first is not None and first.module == "decoder", report.render()
    assert first.entry is not None, report.render()
    assert (first.entry.module, first.entry.argument) == (module, argument), report.render()
    assert detail in first.entry.detail
    expected = f"{module} through its argument {argument}" if first.ops else \
        f"{module} argument {argument}"
    assert expected in report.summary()
    assert report.summary().count("It enters") == 1  # the module, the op, the line at once
    assert expected in " ".join(report.render(width=80).split())
    assert json.loads(report.to_json())["rows"][report.rows.index(first)]["entry"] == {
        "module": module, "argument": argument, "detail": first.entry.detail, "via": "argument"}
    assert expected in report.to_html()


@pytest.mark.parametrize("name", PLANTS)
def test_entry_of_a_divergence_built_by_the_stack(name: str) -> None:
    model_a, model_b, batch = models_for(name)
    report = tp.diagnose(model_a, model_b, batch, loss_fn=sequence_loss)
    assert_entry(report, name)


@pytest.mark.parametrize("name", PLANTS)
def test_entry_found_against_a_recorded_trace(name: str, tmp_path: Path) -> None:
    model_a, model_b, batch = models_for(name)
    trace = tp.record(model_a, batch, tmp_path / "base.tptrace", loss_fn=sequence_loss)
    report = tp.diagnose_against(trace, model_b, batch, loss_fn=sequence_loss)
    assert_entry(report, name)


def test_no_entry_when_a_leaf_module_diverges() -> None:
    model_a, _, batch = models_for("sliding-window")
    model_b = copy.deepcopy(model_a)
    model_b.decoder.layers[1].mlp_norm.eps = 1e-2
    report = tp.diagnose(model_a, model_b, batch, loss_fn=sequence_loss)
    assert report.first_divergence.module == "decoder.layers.1.mlp_norm"
    assert report.first_divergence.entry is None


@pytest.mark.transformers
def test_entry_in_a_transformers_llama_whose_model_shifts_positions() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    model_a = transformers.LlamaForCausalLM(config).eval()
    model_b = copy.deepcopy(model_a)
    forward = type(model_b.model).forward

    class ShiftedPositions(type(model_b.model)):
        def forward(self, input_ids=None, **kwargs):  # the last token one position further
            positions = torch.arange(input_ids.shape[1])
            kwargs["position_ids"] = torch.cat((positions[:-1], positions[-1:] + 1))[None]
            return forward(self, input_ids=input_ids, **kwargs)

    model_b.model.__class__ = ShiftedPositions
    ids = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    # A shift of every position would change nothing but rounding (rotary positions are
    # relative), and the float32 rotary table rounds as both sides' islands allow.
    report = tp.diagnose(model_a, model_b, {"input_ids": ids, "use_cache": False},
                         dtype=torch.float64)
    first = report.first_divergence
    assert first is not None and first.module == "model", report.render()
    assert (first.entry.module, first.entry.argument) == ("model.rotary_emb", "position_ids")
    assert first.entry.detail == "1 of 10 entries differ"
