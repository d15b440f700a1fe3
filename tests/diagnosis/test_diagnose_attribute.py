"""Attribution: shares of the output error carried by the backend and by changed modules."""

from __future__ import annotations

import copy

import pytest
import torch
from test_diagnose import plant_eps, plant_mlp_scale  # the planted changes, a sibling module

import torchparity as tp
from torchparity.errors import UsageError
from torchparity.reference import build_model, zoo
from torchparity.reference.variants import swap_in

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

BACKENDS = ("manual", "sdpa-math")


@pytest.fixture(scope="module")
def llama() -> tuple:
    cfg = zoo.get("llama-tiny").config
    return build_model(cfg, seed=0), zoo.make_batch(cfg, batch_size=2, seq_len=12, seed=0)


def test_backend_carries_the_difference_when_only_the_backend_differs(llama) -> None:
    model_a, batch = llama
    refactored = swap_in(model_a, "fused-qkv")  # same math, other module layout
    report = tp.attribute(model_a, refactored, batch, backends=BACKENDS)
    assert report.total > 0  # the two backends do round differently
    backend = report.unit("backend")
    assert backend.share >= 0.9 and backend.leave_out_share >= 0.9, report.render()
    assert all(u.share <= 0.1 for u in report.units if u.kind == "module")


def test_changed_modules_carry_the_difference_despite_a_backend_change(llama) -> None:
    model_a, batch = llama
    model_b = copy.deepcopy(model_a)
    mlp, norm = plant_mlp_scale(model_b), plant_eps(model_b)
    report = tp.attribute(model_a, model_b, batch, backends=BACKENDS)
    assert {u.name for u in report.units if u.kind == "module"} == {mlp, norm}
    shares = {u.name: u.share for u in report.units}
    assert shares[mlp] + shares[norm] >= 0.9, report.render()
    assert report.unit("backend").share <= 0.1
    assert "explains" in report.summary()


def test_swaps_leave_both_models_as_they_were(llama) -> None:
    model_a, batch = llama
    model_b = copy.deepcopy(model_a)
    planted = plant_mlp_scale(model_b)
    modules_a, modules_b = dict(model_a.named_modules()), dict(model_b.named_modules())
    report = tp.attribute(model_a, model_b, batch, modules=[planted])
    assert [u.name for u in report.units] == [planted] and report.units[0].share > 0.9
    assert dict(model_a.named_modules()) == modules_a
    assert dict(model_b.named_modules()) == modules_b
    with torch.no_grad():
        assert not torch.equal(model_a(**batch), model_b(**batch))


def test_fused_modules_are_listed_as_not_attributable(llama) -> None:
    model_a, batch = llama
    fused = swap_in(model_a, "fused-qkv")
    report = tp.attribute(model_a, fused, batch, modules=["decoder.layers.0.attn.in_proj"])
    assert "fused with decoder.layers.0.attn.q_proj" in report.skipped[
        "decoder.layers.0.attn.in_proj"]
    assert "not attributed: decoder.layers.0.attn.in_proj" in report.render()
    with pytest.raises(UsageError, match="is not an aligned module of model_b"):
        tp.attribute(model_a, fused, batch, modules=["decoder.nowhere"])
