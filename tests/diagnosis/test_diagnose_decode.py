"""Decoding diagnosis: the first step and module where cached decoding parts."""

from __future__ import annotations

import copy

import pytest
import torch

import torchparity as tp
from torchparity.errors import UsageError
from torchparity.reference import KVCache, build_model, greedy_decode, zoo

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster


class StaleSlotCache(KVCache):
    """Hands attention the previous token's value in the newest slot once anything is cached."""

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        k_all, v_all = super().append(layer, k, v)
        if k_all.shape[-2] > k.shape[-2]:
            v_all = torch.cat([v_all[..., :-1, :], v_all[..., -2:-1, :]], dim=-2)
        return k_all, v_all


class OffByOneRotary(modeling_llama.LlamaRotaryEmbedding):
    """Rotates a cached step's token one position too far."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        if position_ids.shape[-1] == 1:
            position_ids = position_ids + 1
        return super().forward(x, position_ids)


@pytest.fixture(scope="module")
def llama() -> tuple:
    cfg = zoo.get("llama-tiny").config
    return build_model(cfg, seed=0), zoo.make_batch(cfg, batch_size=2, seq_len=6, seed=0,
                                                    padding="left")


def test_correct_cache_matches_recompute_and_greedy_tokens(llama) -> None:
    model, batch = llama
    report = tp.diagnose_decode(model, None, batch, steps=4)
    assert report.first_step is None and report.first_module is None
    assert all(step.ok for step in report.steps) and len(report.steps) == 4
    expected = greedy_decode(model, batch, steps=3).tokens  # the reference's own decoder
    assert torch.equal(report.tokens, expected)


@pytest.mark.parametrize("against", ["model_a", "own recompute"])
def test_stale_cache_slot_is_found_at_its_step_and_module(llama, against: str) -> None:
    model_a, batch = llama
    model_b = copy.deepcopy(model_a)
    model_b.new_cache = StaleSlotCache
    if against == "model_a":
        report = tp.diagnose_decode(model_a, model_b, batch, steps=4)
    else:
        report = tp.diagnose_decode(model_b, None, batch, steps=4)
    assert report.first_step == 1, report.render()  # step 0 (the prompt) has no cache yet
    assert report.steps[0].ok
    assert report.first_module.module == "decoder.layers.0.attn", report.render()
    assert "step 1" in report.summary()


def test_position_offset_in_hf_cached_decoding() -> None:
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.model.rotary_emb.__class__ = OffByOneRotary
    ids = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    report = tp.diagnose_decode(model, None, {"input_ids": ids}, steps=3)
    assert report.first_step == 1
    assert report.first_module.module == "model.rotary_emb", report.render()


def test_decode_usage_errors(llama) -> None:
    model, batch = llama
    with pytest.raises(UsageError, match="tokens must be"):
        tp.diagnose_decode(model, None, batch, steps=4, tokens=torch.zeros(2, 1, dtype=int))
    with pytest.raises(UsageError, match="dict of keyword arguments"):
        tp.diagnose_decode(model, None, (batch["input_ids"],))
    with pytest.raises(UsageError, match="decoding="):
        tp.diagnose_decode(torch.nn.Linear(2, 2), None, batch)
