"""The twins strategies draw what they say: every mask convention encodes the same visible
keys, padded rows (fully padded ones too) and single tokens occur, decoding steps add up, and
constructor arguments follow the ranges given."""

from __future__ import annotations

import pytest
import torch
from hypothesis import find, given
from hypothesis import strategies as st

from torchparity.twins import strategies as tpt


def visible(inputs: dict, convention: str, q: int, k: int) -> torch.Tensor:
    """(batch, q, k) bool: which keys each query may see, read back from the mask."""
    mask = inputs.get("attention_mask")
    batch = inputs["hidden_states"].shape[0]
    causal = tpt.causal(q, k).expand(batch, q, k)
    if convention in ("none", "causal"):
        return causal
    if convention == "key-padding":
        return causal & mask.bool()[:, None, :]
    if convention == "bool-attend":
        return mask[:, 0]
    if convention == "bool-masked":
        return ~mask[:, 0]
    return mask[:, 0] == 0


@pytest.mark.parametrize("convention", tpt.MASKS)
@given(data=st.data())
def test_every_convention_hides_exactly_the_padding_and_the_future(convention, data):
    example = data.draw(tpt.attention_inputs(8, mask=convention, positions=(0, 300)))
    hidden = example.inputs["hidden_states"]
    batch, length, _ = hidden.shape
    real = torch.ones(batch, length, dtype=torch.bool) if example.padding is None \
        else ~example.padding
    expected = tpt.causal(length, length)[None] & real[:, None, :]
    assert torch.equal(visible(example.inputs, convention, length, length), expected)
    positions = example.inputs["position_ids"]
    # Position ids count real tokens: each real token is one past the real token before it.
    for row, ids in zip(real, positions, strict=True):
        steps = ids[row].diff()
        assert torch.equal(steps, torch.ones_like(steps))


def test_the_strategies_reach_one_token_and_fully_padded_rows():
    one_token = find(tpt.attention_inputs(8), lambda e: e.inputs["hidden_states"].shape[1] == 1)
    assert one_token.inputs["hidden_states"].shape == (1, 1, 8)
    empty = find(tpt.attention_inputs(8, padding="left"),
                 lambda e: e.padding is not None and bool(e.padding.all(-1).any()))
    assert empty.inputs["attention_mask"].sum(-1).min() == 0
    additive = find(tpt.attention_inputs(8, mask="additive"), lambda e: e.padding is not None
                    and bool(e.padding.any()))
    assert additive.inputs["attention_mask"].min() == torch.finfo(torch.float16).min


@given(example=tpt.decoding_inputs(8, history=(1, 5), chunks=(1, 3), chunk=(1, 4)))
def test_decoding_steps_are_a_history_then_chunks(example):
    lengths = [step["hidden_states"].shape[1] for step in example.inputs]
    assert 1 <= lengths[0] <= 5 and 2 <= len(lengths) <= 4
    assert all(1 <= n <= 4 for n in lengths[1:])


@given(arguments=tpt.constructor_args(n_heads=[1, 2, 4],
                                      n_kv_heads=lambda a: tpt.divisors(a["n_heads"]),
                                      d_model=lambda a: 8 * a["n_heads"], window=(1, 8)))
def test_constructor_arguments_follow_their_ranges(arguments):
    assert arguments["n_heads"] % arguments["n_kv_heads"] == 0
    assert arguments["d_model"] == 8 * arguments["n_heads"]
    assert 1 <= arguments["window"] <= 8
