"""What a module's state holds: written extents, not capacities, and never-written slots."""

from __future__ import annotations

import torch

from torchparity.diagnosis.core.state import Held, state_difference


def _cache(capacity: int, written: list[int]) -> torch.Tensor:
    buffer = torch.zeros(1, 2, capacity, 4)
    buffer[..., written, :] = torch.randn(1, 2, len(written), 4,
                                          generator=torch.Generator().manual_seed(0))
    return buffer


def test_a_buffer_is_judged_by_what_it_holds_not_by_its_capacity() -> None:
    held = Held.of(_cache(16, list(range(11))))
    assert held.shape == (1, 2, 16, 4) and held.extent == (1, 2, 11, 4) and held.holes == {}
    concatenated = {"state.k_cache": Held.of(_cache(11, list(range(11))))}
    assert state_difference(concatenated, {"state.k_cache": held}) is None


def test_a_slot_never_written_is_named_with_both_lengths() -> None:
    a = {"state.k_cache": Held.of(_cache(11, list(range(11))))}
    b = {"state.k_cache": Held.of(_cache(16, [*range(10), 11]))}
    assert state_difference(a, b) == (
        "state.k_cache", "holds 12 positions in B, 11 in A; B never wrote position 10 "
                         "(all zeros)")
    assert Held.from_json(b["state.k_cache"].to_json()) == b["state.k_cache"]


def test_other_dimensions_are_named_by_index() -> None:
    a = {"kwargs.cache.keys": Held.of(torch.ones(2, 3))}
    b = {"kwargs.cache.keys": Held.of(torch.ones(3, 3))}
    assert state_difference(a, b) == ("kwargs.cache.keys",
                                      "holds 3 positions in B, 2 in A")
    a = {"x": Held.of(torch.ones(2, 3, 4))}
    b = {"x": Held.of(torch.ones(3, 3, 4))}
    assert state_difference(a, b) == ("x", "holds 3 entries along dim 0 in B, 2 in A")
