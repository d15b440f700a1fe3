"""A's attention gets a mask sized to a static cache, B's one of the keys in use: B's replay
on A's recorded inputs trims the mask where the keys it drops are masked for every query, pads
it with masked keys where B's holds more, and says so on the row; a mask whose extra keys some
query attends is left as recorded, and the local error stays unknown. A's arguments are handed
to B's parameters by meaning first: a mask passed by keyword or renamed is fitted too."""

from __future__ import annotations

import pytest
import torch
from masked_models import (
    DIM,
    BiasedAttention,
    CachedMask,
    MovedBiasAttention,
    RenamedMaskAttention,
    TemperedAttention,
)

import torchparity as tp
from torchparity.diagnosis.core.masks import fitted_keys, readings

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

TRIMMED = "mask args.1 trimmed from 16 to 5 keys: the 11 others are masked for every query"


def _x() -> torch.Tensor:
    return torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("planted", [False, True])
def test_a_cache_sized_mask_is_trimmed_to_the_keys_b_attends(planted: bool) -> None:
    """B's attention computes what A's does on the first 5 keys: fed the trimmed mask it is
    bit-identical; with its projection scaled it diverges, the projection first."""
    a, b = CachedMask(False), CachedMask(True)
    if planted:
        with torch.no_grad():
            b.attn.proj.weight.mul_(2.0)
    report = tp.diagnose(a, b, (_x(),), backward=False, local="all")
    attn = report.row("attn")
    assert attn.local is not None
    assert attn.local.verdict == ("diverged" if planted else "identical")
    assert TRIMMED in attn.notes
    assert not any(note.startswith("local error unknown") for note in attn.notes)
    first = report.first_divergence
    assert (first.module if first is not None else None) == ("attn.proj" if planted else None)


def test_a_mask_whose_extra_keys_are_attended_is_not_trimmed() -> None:
    a, b = CachedMask(False, spare=0.0), CachedMask(True)
    attn = tp.diagnose(a, b, (_x(),), backward=False, local="all").row("attn")
    assert attn.local is None
    assert not any("trimmed" in note for note in attn.notes)
    assert any(note.startswith("local error unknown") for note in attn.notes)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.bfloat16])
def test_fitting_keeps_the_keys_each_query_attends(dtype: torch.dtype) -> None:
    """Trimmed to 5 keys and padded back to 16, a causal mask over 5 of 16 cached keys lets
    every query attend the keys it attended: the round trip of a mask is itself."""
    attends = torch.ones(5, 16, dtype=torch.bool).tril()
    mask = attends if dtype == torch.bool else torch.zeros(5, 16, dtype=dtype).masked_fill(
        ~attends, torch.finfo(dtype).min)
    trimmed, _ = fitted_keys(mask, 5)
    padded, note = fitted_keys(trimmed, 16)
    assert torch.equal(next(iter(readings(padded).values())), attends)
    assert note == "padded from 5 to 16 keys: the 11 added are masked for every query"
    attends[0, 10] = True  # one query attends a key past the 5
    assert fitted_keys(attends, 5) is None


def test_a_mask_b_takes_as_recorded_is_not_fitted() -> None:
    """B's attention slices its mask as A's does: fed A's 16 keys it runs, and the mask is
    left as recorded (no note), though B's own call had 5."""
    a, b = CachedMask(False), CachedMask(True)
    b.attn.sliced = True
    attn = tp.diagnose(a, b, (_x(),), backward=False, local="all").row("attn")
    assert attn.local is not None and attn.local.verdict == "identical"
    assert not any(note.startswith("mask ") for note in attn.notes)


@pytest.mark.parametrize("planted", [False, True])
@pytest.mark.parametrize("a_side", [
    {},  # A hands the mask by position, B by keyword
    {"attention": RenamedMaskAttention, "keyword": "attention_mask"},  # B renamed it
])
def test_a_mask_handed_by_another_name_or_way_is_fitted(a_side: dict, planted: bool) -> None:
    """B's attention takes A's mask under its own parameter: fitted there, it is
    bit-identical, and a change planted inside it is still named."""
    a, b = CachedMask(False, **a_side), CachedMask(True, keyword="mask")
    if planted:
        with torch.no_grad():
            b.attn.proj.weight.mul_(2.0)
    report = tp.diagnose(a, b, (_x(),), backward=False, local="all")
    attn = report.row("attn")
    assert attn.local is not None, attn.notes
    assert attn.local.verdict == ("diverged" if planted else "identical")
    notes = "; ".join(attn.notes)
    assert TRIMMED in notes  # the mask as B's forward binds it: its second argument
    renamed = "A's attention_mask handed to B's mask; " in notes
    assert renamed == ("attention" in a_side)
    first = report.first_divergence
    assert (first.module if first is not None else None) == ("attn.proj" if planted else None)


@pytest.mark.parametrize(("a", "b", "why"), [
    ({}, {"attention": TemperedAttention, "also": {"temperature": 1.0}},
     "missing a required argument: 'temperature'"),  # B requires what A never passed
    ({"attention": BiasedAttention, "keyword": "attention_mask", "also": {"bias": 0.0}},
     {"attention": MovedBiasAttention, "also": {"bias": 0.0}},
     "no parameter that A's argument attention_mask surely maps to"),  # renamed and moved
])
def test_arguments_without_a_sound_mapping_leave_the_local_error_unknown(a, b, why) -> None:
    report = tp.diagnose(CachedMask(False, **a), CachedMask(True, keyword="mask", **b),
                         (_x(),), backward=False, local="all")
    attn = report.row("attn")
    assert attn.local is None
    assert any(note.startswith("local error unknown: A's recorded arguments do not fit") and
               why in note for note in attn.notes), attn.notes
    assert ("The local error of 1 module(s) is unknown, their replay on A's inputs failed "
            "(attn); the verdict could depend on them") in " ".join(report.summary().split())
