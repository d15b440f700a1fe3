"""Arguments compared by meaning, and shapes that are not structure.

A refactor renames a keyword argument whose value is None on both sides: no difference. A
tensor both sides return in different shapes (attention over one more key) is a divergence of
its own, and where one enters.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchparity as tp
from torchparity.diagnosis.core.arguments import argument_difference

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

X = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
SIGNATURE_A = [("x", "POSITIONAL_OR_KEYWORD"), ("mask", "POSITIONAL_OR_KEYWORD"),
               ("bias", "KEYWORD_ONLY")]
SIGNATURE_B = [("x", "POSITIONAL_OR_KEYWORD"), ("attn_mask", "POSITIONAL_OR_KEYWORD"),
               ("bias", "KEYWORD_ONLY")]


@pytest.mark.parametrize(("a_kwargs", "b_kwargs", "expected"), [
    ({"mask": None}, {"attn_mask": None}, None),  # renamed, None on both sides
    ({"mask": None}, {}, None),  # None on one side is not passing it
    ({"mask": X[0, 0] > 0}, {"attn_mask": X[0, 0] > 0}, None),  # renamed, the same tensor
    ({"mask": X[0, 0] > 0}, {"attn_mask": X[0, 0] > 1}, "mask (B: attn_mask)"),
    ({"bias": X[0]}, {"bias": X[0, :, :7]}, "bias"),
])
def test_arguments_are_bound_and_paired_by_meaning(a_kwargs, b_kwargs, expected) -> None:
    found = argument_difference(SIGNATURE_A, ((X,), a_kwargs), SIGNATURE_B, ((X,), b_kwargs))
    assert (found and found.argument) == expected
    if expected == "bias":
        assert found.detail == "shape differs: (5, 8) vs (5, 7) (A vs B)"


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask=None, *, bias):
        scores = x @ x.transpose(-1, -2) / 8 ** 0.5 + bias
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return self.proj(scores.softmax(-1) @ x)


class RenamedAttention(Attention):
    def forward(self, x, attn_mask=None, *, bias):
        return super().forward(x, attn_mask, bias=bias)


class Layer(nn.Module):
    def __init__(self, renamed: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.attn = RenamedAttention() if renamed else Attention()
        self.keyword = "attn_mask" if renamed else "mask"

    def forward(self, x, bias):
        return x + self.attn(self.norm(x), **{self.keyword: None}, bias=bias)


class Stack(nn.Module):
    """Layers sharing a distance bias the stack builds once; B's refactor also renamed the
    attention's mask keyword (always None here) and gives a token distance 1 to itself."""

    def __init__(self, refactored: bool) -> None:
        super().__init__()
        self.refactored = refactored
        self.layers = nn.ModuleList(Layer(refactored) for _ in range(2))

    def forward(self, x):
        positions = torch.arange(x.shape[1])
        distance = (positions[:, None] - positions[None, :]).abs().float()
        bias = -0.5 * (distance.clamp(min=1) if self.refactored else distance)
        for layer in self.layers:
            x = layer(x, bias)
        return x


def _stacks() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    a = nn.Sequential(Stack(refactored=False))
    b = nn.Sequential(Stack(refactored=True))
    b.load_state_dict(a.state_dict())
    return a, b


def test_a_renamed_keyword_none_on_both_sides_is_not_where_the_change_enters() -> None:
    a, b = _stacks()
    report = tp.diagnose(a, b, (X,), backward=False)
    first = report.first_divergence
    assert first.module == "0" and first.entry is not None, report.render()
    assert (first.entry.module, first.entry.argument) == ("0.layers.0.attn", "bias")


class Probs(nn.Module):
    """Returns attention probabilities; B's refactor attends to one extra zero key."""

    def __init__(self, extra_key: bool) -> None:
        super().__init__()
        self.extra_key = extra_key
        self.qk = nn.Linear(8, 16)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, -1)
        if self.extra_key:
            k = torch.cat((k, torch.zeros_like(k[:, :1])), dim=1)
        return (q @ k.transpose(-1, -2)).softmax(-1)


def test_a_shape_that_differs_is_a_divergence_not_structure() -> None:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 8), Probs(extra_key=False))
    b = nn.Sequential(nn.Linear(8, 8), Probs(extra_key=True))
    b.load_state_dict(a.state_dict())
    report = tp.diagnose(a, b, (X,), backward=False)
    first = report.first_divergence
    assert first is not None and first.module == "1", report.render()
    assert [(d.path, d.golden, d.candidate) for d in first.shapes] == [
        ("output", (2, 5, 5), (2, 5, 6))]
    assert not report.structure_only
    text = report.render(80)
    assert "shape differs at output: (2, 5, 5) vs (2, 5, 6) (A vs B)" in text
    assert "X shape" in text
    assert report.row("1").to_dict()["shapes"] == [
        {"path": "output", "a": [2, 5, 5], "b": [2, 5, 6]}]
