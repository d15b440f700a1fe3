"""Masks by meaning: the masks a tiny ``transformers`` Llama hands its attention under eager
(additive float) and sdpa (boolean) attention mean the same; a mask that lets one padded key
reach a real query does not, one that changes a padded query's row does; other tensors are no
masks."""

from __future__ import annotations

import copy

import pytest
import torch

from tiny_transformers import llama
from torchparity.diagnosis.core.masks import by_meaning, readings
from torchparity.subject import hf

pytestmark = pytest.mark.transformers

PAD = 3  # padded positions at the left of the second sequence


@pytest.fixture(scope="module")
def handed_masks() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention_mask each implementation hands its first attention, and the padding."""
    model = llama().eval()
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :PAD] = 0
    found = {}
    for implementation in ("eager", "sdpa"):
        copied = copy.deepcopy(model)
        hf.set_attention(copied, implementation)
        copied.model.layers[0].self_attn.register_forward_pre_hook(
            lambda module, args, kwargs, key=implementation: found.__setitem__(
                key, kwargs["attention_mask"]), with_kwargs=True)
        with torch.no_grad():
            copied(input_ids=torch.randint(1, 64, (2, 8)), attention_mask=mask)
    return found["eager"], found["sdpa"], mask == 0


def test_eager_and_sdpa_masks_mean_the_same(handed_masks):
    eager, sdpa, pad = handed_masks
    assert eager.is_floating_point() and sdpa.dtype == torch.bool
    assert set(readings(eager)) == {"additive float"}
    assert by_meaning(eager, sdpa, pad).same
    assert by_meaning(eager, ~sdpa, pad).same  # a boolean "masked" form of the same mask


def test_a_padded_key_reaching_real_queries_differs(handed_masks):
    eager, sdpa, pad = handed_masks
    leaky = sdpa.clone()
    leaky[1, :, PAD:, 0] = True  # padded key 0 visible to every real query of the row
    meaning = by_meaning(eager, leaky, pad)
    real_queries, judged_queries = 8 - PAD, int((~pad).sum())
    assert meaning.detail == (f"{real_queries} of {judged_queries * 8} (query, key) pairs of"
                              " judged queries attend otherwise (A: additive float mask, B:"
                              " boolean attend mask)")


def test_a_padded_querys_row_is_not_judged(handed_masks):
    eager, sdpa, pad = handed_masks
    changed = sdpa.clone()
    changed[1, :, 0, :] = True  # the first padded query now attends to everything
    assert by_meaning(eager, changed, pad).same
    assert not by_meaning(eager, changed, None).same  # without the padding it is judged


def test_two_boolean_masks_keep_one_convention(handed_masks):
    _, sdpa, pad = handed_masks
    assert not by_meaning(sdpa, ~sdpa, pad).same


def test_broadcast_masks_compare_by_meaning():
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    additive = torch.zeros(2, 1, 4, 4).masked_fill(~causal, float("-inf"))
    assert by_meaning(additive, causal[None, None]).same


@pytest.mark.parametrize("other", [
    torch.randn(2, 1, 8, 8),  # a hidden state
    -torch.arange(8.0).expand(2, 1, 8, 8),  # an ALiBi-like bias: no mask
    torch.full((2, 1, 8, 3), 0.0),  # shapes that do not broadcast
])
def test_what_is_no_mask_is_left_to_the_plain_comparison(handed_masks, other):
    eager, _, pad = handed_masks
    assert by_meaning(eager, other, pad) is None
