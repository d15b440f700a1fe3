"""Padded positions left out of a comparison: ``compare(..., padding=mask)`` judges exactly what
judging the unpadded elements alone judges, whatever the padded positions hold (NaN included),
and says how many positions it left out and why."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchparity.comparison import compare
from torchparity.comparison.selection import LeftOut


@st.composite
def padded_triples(draw: st.DrawFn) -> tuple[torch.Tensor, ...]:
    """(candidate fp32, golden fp64, baseline fp32, pad) with garbage at padded positions."""
    batch, length, width = draw(st.integers(1, 3)), draw(st.integers(2, 6)), draw(
        st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.randn(batch, length, width, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed))
    baseline = g.float()
    candidate = (g + 1e-7 * torch.randn(g.shape, dtype=torch.float64,
                                        generator=torch.Generator().manual_seed(seed + 1))).float()
    lengths = [draw(st.integers(1, length)) for _ in range(batch)]
    left = draw(st.booleans())
    index = torch.arange(length)
    pad = torch.stack([index < length - n if left else index >= n for n in lengths])
    garbage = draw(st.sampled_from([float("nan"), float("inf"), 1e30, -7.0]))
    candidate[pad] = garbage
    return candidate, g, baseline, pad


@given(padded_triples(), st.sampled_from(["forward", "grad"]))
def test_padding_judges_what_the_unpadded_elements_alone_judge(triple, kind):
    candidate, golden, baseline, pad = triple
    keep = ~pad
    padded = compare(candidate, golden, baseline, kind, padding=pad)
    alone = compare(candidate[keep], golden[keep], baseline[keep], kind,
                    reduction_length=golden.shape[-1])
    (t,), (u,) = padded.tensors, alone.tensors
    assert t.verdict == u.verdict
    assert t.error == u.error and t.budget.value == u.budget.value
    assert t.budget.scale == u.budget.scale and t.n_over == u.n_over
    assert t.notes == u.notes  # a NaN or inf at a padded position is no fault
    assert (t.left_out, t.positions) == ((int(pad.sum()), pad.numel()) if pad.any() else (0, 0))
    if t.worst_index is not None:
        assert not pad[t.worst_index[:2]]


def test_gradient_groups_take_their_scale_and_noise_from_unpadded_positions():
    g = torch.randn(2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, :3] = True
    big = g.clone()
    big[pad] = 1e6  # a huge golden value at a padded position must not set the group's scale
    tensors = {"a": big, "b": g * 1e-3}
    baseline = {k: v.float() for k, v in tensors.items()}
    padded = compare(baseline, tensors, baseline, "grad", padding=pad)
    keep = ~pad
    alone = compare({k: v[keep] for k, v in baseline.items()},
                    {k: v[keep] for k, v in tensors.items()},
                    {k: v[keep] for k, v in baseline.items()}, "grad", reduction_length=4)
    for t, u in zip(padded.tensors, alone.tensors, strict=True):
        assert t.budget.group_scale == u.budget.group_scale
        assert t.budget.value == u.budget.value


def test_a_change_at_an_unpadded_position_still_diverges():
    g = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, :2] = True
    candidate = g.float()
    candidate[1, 2, 0] += 0.5  # the first real token of the padded row
    result = compare(candidate, g, g.float(), padding=pad)
    assert not result.ok and result.worst.worst_index == (1, 2, 0)


def test_reports_say_how_many_positions_were_left_out_and_why():
    g = {"logits": torch.randn(2, 4, 3, dtype=torch.float64), "loss": torch.tensor(1.0,
                                                                                    dtype=torch.float64)}
    c = {k: v.float() for k, v in g.items()}
    pad = torch.tensor([[False] * 4, [True, True, False, False]])
    result = compare(c, g, c, padding=pad)
    assert "Left out of the judgement: 2 of 8 positions of 1 tensor(s), padding per the mask" \
        " given." in result.explain()
    data = json.loads(json.dumps(result.to_dict()))
    assert data["left_out"] == [{"path": 'outputs["logits"]', "positions": 2, "of": 8,
                                 "reason": "padding per the mask given"}]
    assert {t["path"]: t["left_out"] for t in data["tensors"]} == {
        'outputs["logits"]': 2, 'outputs["loss"]': 0}


def test_exact_tensors_are_compared_on_unpadded_positions_only():
    ids = torch.tensor([[5, 6, 7], [0, 0, 9]])
    other = torch.tensor([[5, 6, 7], [4, 4, 9]])
    pad = torch.tensor([[False, False, False], [True, True, False]])
    assert compare(other, ids, padding=pad).ok
    assert not compare(other, ids).ok
    other[1, 2] = 1
    assert not compare(other, ids, padding=pad).ok


def test_a_function_says_per_tensor_what_is_left_out():
    g = {"enc": torch.randn(2, 3, dtype=torch.float64), "dec": torch.randn(2, 3,
                                                                            dtype=torch.float64)}
    c = {k: v.float() for k, v in g.items()}
    c["dec"][0, 0] = float("nan")
    pad = torch.tensor([[True, False, False], [False, False, False]])

    def decoder_only(path, tensor):
        return LeftOut(pad, "padding of the decoder") if "dec" in path else None

    result = compare(c, g, c, padding=decoder_only)
    assert result.ok and [t.left_out for t in result.tensors] == [0, 1]
    assert not compare(c, g, c, padding=lambda path, t: None).ok


@pytest.mark.parametrize("padding, message", [
    (torch.ones(2, 3, dtype=torch.long), "pass attention_mask == 0"),
    (lambda path, t: LeftOut(torch.ones(3, 2, dtype=torch.bool), "x"), "cover the leading"),
])
def test_a_mask_that_cannot_say_padding_is_refused_in_one_line(padding, message):
    g = torch.randn(2, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=message) as error:
        compare(g.float(), g, padding=padding)
    assert "\n" not in str(error.value)
