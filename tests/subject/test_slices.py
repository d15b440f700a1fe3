"""Where a rank's plain slice of a parameter lies in the one-process weight
(``torchparity.subject.slices``): declared by a factory, or found by matching values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchparity.errors import UsageError
from torchparity.subject import slices


def test_a_declared_split_places_rank_r_at_the_r_th_of_equal_slices():
    held = nn.Linear(4, 3)  # rank 1's 3 of 6 output rows
    found = slices.declared_slices(held, {"weight": 0, "bias": -1}, ranks=2, rank=1,
                                   label="f.py:m")
    assert found.of("weight") == slices.Slice(dim=0, start=3, length=3, whole=(6, 4))
    assert found.of("bias") == slices.Slice(dim=0, start=3, length=3, whole=(6,))
    whole = torch.arange(24.0).view(6, 4)
    assert torch.equal(slices.cut(whole, found.of("weight")), whole[3:])


@pytest.mark.parametrize(("dims", "said"), [
    ({"wieght": 0}, "declares shards of 'wieght', which its model does not have"),
    ({"weight": 2}, "declares weight (shape (3, 4)) split along dimension 2"),
])
def test_a_declared_split_the_model_does_not_have_is_one_line(dims, said):
    with pytest.raises(UsageError, match=said.replace("(", r"\(").replace(")", r"\)")):
        slices.declared_slices(nn.Linear(4, 3), dims, ranks=2, rank=0, label="f.py:m")


def test_a_slice_is_found_where_its_values_lie_and_nowhere_when_it_is_no_stretch():
    whole = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    assert slices._located(whole[4:6], whole) == slices.Slice(0, 4, 2, (8, 4))
    assert slices._located(whole[:, 2:], whole) == slices.Slice(1, 2, 2, (8, 4))
    assert slices._located(whole[1::4], whole) is None  # dealt in turn, not a stretch
    assert slices._located(whole[4:6] + 2**-20, whole) is None  # bit for bit only
