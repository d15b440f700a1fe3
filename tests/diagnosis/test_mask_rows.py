"""A's attention gets a causal mask over every position of a static cache and picks its
queries' rows by ``cache_position`` (transformers 4.38); B's gets one row per query
(4.39): B's replay on A's recorded inputs takes the rows A's attention takes, then trims the
keys no query attends, and says so on the row."""

from __future__ import annotations

import pytest
import torch
from masked_models import DIM, SquareCachedMask

import torchparity as tp
from torchparity.diagnosis.core.masks import fitted_queries

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

PICKED = ("mask args.1 rows of queries 0..4 of 16 picked by cache_position, as A's attention "
          "picks them, trimmed from 16 to 5 keys: the 11 others are masked for every query")


@pytest.mark.parametrize("planted", [False, True])
def test_a_mask_over_the_whole_cache_is_read_at_the_queries_positions(planted: bool) -> None:
    """Fed the picked rows, B's attention is bit-identical to A's; with its projection scaled
    it diverges, the projection first."""
    x = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(1))
    a, b = SquareCachedMask(False), SquareCachedMask(True)
    if planted:
        with torch.no_grad():
            b.attn.proj.weight.mul_(2.0)
    report = tp.diagnose(a, b, (x,), backward=False, local="all")
    attn = report.row("attn")
    assert attn.local is not None, attn.notes
    assert attn.local.verdict == ("diverged" if planted else "identical")
    assert PICKED in attn.notes
    first = report.first_divergence
    assert (first.module if first is not None else None) == ("attn.proj" if planted else None)


def test_rows_are_picked_only_where_the_positions_say_which() -> None:
    """The rows picked are the mask's rows at the positions, in their order; positions of
    another count, past the mask, or absent pick nothing."""
    mask = torch.full((1, 8, 8), float("-inf")).triu(1)
    picked, _ = fitted_queries(mask, torch.tensor([3, 4]), 2)
    assert torch.equal(picked, mask[:, 3:5])
    assert fitted_queries(mask, torch.tensor([3, 4]), 3) is None
    assert fitted_queries(mask, torch.tensor([7, 8]), 2) is None
    assert fitted_queries(mask, None, 2) is None
