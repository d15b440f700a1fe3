"""Tests of per-module capture: selection, order, inputs/outputs, gradients, stats, streaming."""

from __future__ import annotations

import copy
import re
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

import torchparity as tp
from torchparity.diagnosis.core.capture import (
    Capture,
    ModuleCall,
    TensorStats,
    call_key,
    module_filter,
    snapshot,
)
from torchparity.subject.trees import flatten_tensors, map_tensors

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return x + scale * self.fc(self.norm(x))


class Net(nn.Module):
    def __init__(self, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, scale=0.5)
        return {"logits": self.head(h), "hidden": h}


@pytest.fixture
def net() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(1))


def test_filter_glob_regex_and_exclude() -> None:
    names = ["", "embed", "blocks.0", "blocks.0.fc", "blocks.1.fc", "head"]
    pick = lambda f: [n for n in names if f(n)]  # noqa: E731
    assert pick(module_filter("blocks.*.fc")) == ["blocks.0.fc", "blocks.1.fc"]
    assert pick(module_filter("re:^blocks\\.1")) == ["blocks.1.fc"]
    assert pick(module_filter(re.compile(r"fc$"))) == ["blocks.0.fc", "blocks.1.fc"]
    assert pick(module_filter(["embed", "head"])) == ["embed", "head"]
    assert pick(module_filter(None, exclude="blocks*")) == ["", "embed", "head"]
    assert pick(module_filter(lambda n: n.endswith("0"))) == ["blocks.0"]


def test_records_follow_execution_order(net: Net, x: torch.Tensor) -> None:
    with Capture(net) as cap:
        net(x)
    finished = [r.name for r in cap.records]
    # Children finish before their parent; the root finishes last.
    assert finished == ["embed", "blocks.0.norm", "blocks.0.fc", "blocks.0",
                        "blocks.1.norm", "blocks.1.fc", "blocks.1", "head", ""]
    started = [r.name for r in sorted(cap.records, key=lambda r: r.start)]
    assert started == ["", "embed", "blocks.0", "blocks.0.norm", "blocks.0.fc", "blocks.1",
                       "blocks.1.norm", "blocks.1.fc", "head"]
    assert cap["blocks.1.fc"].depth == 3 and cap[""].depth == 0
    assert cap["blocks.0"].module_type == "Block"


def test_outputs_and_inputs_match_a_manual_forward(net: Net, x: torch.Tensor) -> None:
    with Capture(net, include="blocks.*") as cap:
        out = net(x)
    h0 = net.embed(x)
    h1 = h0 + 0.5 * net.blocks[0].fc(net.blocks[0].norm(h0))
    block1 = cap["blocks.1"]
    assert torch.equal(block1.args[0], h1)
    assert block1.kwargs == {"scale": 0.5}
    assert torch.equal(block1.outputs["output"], out["hidden"])
    assert "embed" not in cap and "" not in cap
    assert cap["blocks.0.fc"].output_shapes == {"output": (2, 5, 8)}


def test_inputs_are_copied_before_in_place_changes() -> None:
    class Mutating(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            x.add_(100)  # callers may reuse and mutate buffers
            return y

    model = nn.Sequential(Mutating())
    x = torch.ones(3)
    with Capture(model) as cap:
        model(x.clone())
    assert torch.equal(cap["0"].args[0], torch.ones(3))
    assert torch.equal(cap["0"].output, torch.full((3,), 2.0))


def test_repeated_calls_get_their_own_keys() -> None:
    shared = nn.Linear(3, 3)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = shared

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.shared(self.shared(x))

    model = Twice()
    x = torch.randn(2, 3)
    with Capture(model) as cap:
        model(x)
    assert cap.keys() == ["shared", "shared#1", ""]
    assert call_key("shared", 1) == "shared#1"
    assert torch.equal(cap["shared#1"].args[0], shared(x))


def _output_grads(net: Net, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """d loss / d (output of block 0 and of the head) for loss = sum(logits^2), asked of
    autograd directly on a fresh forward."""
    h1 = net.blocks[0](net.embed(x), scale=0.5)
    logits = net.head(net.blocks[1](h1, scale=0.5))
    (block0,) = torch.autograd.grad(logits.square().sum(), h1)
    return {"blocks.0": block0, "head": 2 * logits.detach()}


def test_grads_of_outputs_match_autograd(net: Net, x: torch.Tensor) -> None:
    with Capture(net, grads=True) as cap:
        out = net(x)
        out["logits"].square().sum().backward()
    captured = {name: cap[name].grad_output["output"] for name in ("blocks.0", "head")}
    golden = _output_grads(copy.deepcopy(net).double(), x.double())
    tp.assert_parity(captured, golden, baseline=_output_grads(net, x), kind="grad")


def test_stats_mode_keeps_no_tensors(net: Net, x: torch.Tensor) -> None:
    with Capture(net, what="stats", grads=True) as cap:
        net(x)["logits"].sum().backward()
    head = cap["head"]
    assert head.output is None and head.args is None and head.grad_output == {}
    expected = net.head(net(x)["hidden"]).detach().numpy().astype(np.float64)
    stats = head.output_stats["output"]
    assert stats.shape == expected.shape and stats.dtype == "float32" and stats.nonfinite == 0
    assert stats.mean == pytest.approx(expected.mean())
    assert stats.std == pytest.approx(expected.std())
    assert stats.absmax == pytest.approx(np.abs(expected).max())
    assert head.grad_stats["output"].mean == 1.0  # d sum / d logits is all ones
    assert set(cap["blocks.0"].input_stats) == {"args.0"}


def test_stats_count_non_finite_values() -> None:
    stats = TensorStats.of(torch.tensor([1.0, float("nan"), 3.0, float("inf")]))
    assert stats.nonfinite == 2 and stats.mean == 2.0 and stats.absmax == 3.0


def test_streaming_sees_every_call_and_keeps_nothing(net: Net, x: torch.Tensor) -> None:
    had_tensors: dict[str, bool] = {}
    grads: dict[str, torch.Tensor] = {}
    with Capture(net, what="outputs", grads=True, keep=False,
                 on_call=lambda c: had_tensors.__setitem__(c.key, bool(c.outputs)),
                 on_grad=lambda c, p, g: grads.__setitem__(c.key, g)) as cap:
        net(x)["logits"].sum().backward()
    assert all(had_tensors.values())
    assert list(had_tensors) == cap.keys()
    assert all(r.output is None and r.grad_output == {} for r in cap.records)
    assert cap["head"].output_shapes == {"output": (2, 5, 3)}
    # d sum / d logits is all ones.
    tp.assert_parity(grads["head"], torch.ones(2, 5, 3, dtype=torch.float64), kind="grad")


def test_hooks_are_removed_even_after_an_error(net: Net) -> None:
    with pytest.raises(RuntimeError), Capture(net):
        net(torch.randn(2, 7))  # wrong width
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in net.modules())


def test_paused_calls_are_not_recorded(net: Net, x: torch.Tensor) -> None:
    with Capture(net) as cap:
        with cap.paused():
            net(x)
        net.head(torch.randn(1, 8))
    assert cap.keys() == ["head"]


@pytest.mark.transformers
def test_flatten_and_map_handle_pytrees_and_model_outputs() -> None:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    Pair = namedtuple("Pair", "a b")

    @dataclass
    class Out:
        x: torch.Tensor
        extra: tuple

    t = torch.ones(2)
    tree = {"m": CausalLMOutputWithPast(logits=t), "p": Pair(t, None), "d": Out(t, (t, "s"))}
    assert list(flatten_tensors(tree)) == [
        "output.m.logits", "output.p.0", "output.d.x", "output.d.extra.0"]
    doubled = map_tensors(tree, lambda v: v * 2)
    assert isinstance(doubled["m"], CausalLMOutputWithPast) and isinstance(doubled["p"], Pair)
    assert doubled["m"].logits.tolist() == [2.0, 2.0] and doubled["d"].extra[1] == "s"
    assert flatten_tensors(t) == {"output": t}


def test_a_shared_copy_is_one_per_memory_unchanged_since() -> None:
    class ChangesItsInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Identity(), nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.first(x)  # x itself
            x.add_(1)
            return self.second(y)

    model = ChangesItsInput()
    kept: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_call(call: ModuleCall) -> None:
        # live: the output itself, detached (another tensor object reading the same memory)
        kept[call.key] = (call.args[0], cap.copy(call.outputs["output"]))

    with Capture(model, what="tensors", share=True, keep=False, live=True,
                 on_call=on_call) as cap:
        model(torch.zeros(3))
    (first_in, first_out), (second_in, _) = kept["first"], kept["second"]
    assert first_out is first_in  # one copy of one memory
    assert second_in is not first_in  # changed in place in between: a copy of its own
    assert torch.equal(first_in, torch.zeros(3)) and torch.equal(second_in, torch.ones(3))


def test_shared_copies_of_an_inference_mode_run(net: Net, x: torch.Tensor) -> None:
    # Inference tensors have no version counter to tell a change by: each gets its own copy.
    with torch.inference_mode():
        expected = net(x)["logits"]
        with Capture(net, share=True) as cap:
            net(x)
    assert torch.equal(cap["head"].output, expected)


@dataclass
class _FieldLess:
    """transformers 4.38's ``Cache``: a dataclass without fields."""


class _ListCache(_FieldLess):
    """4.38's ``DynamicCache``: its tensors in attributes of its own, set by its ``__init__``."""

    def __init__(self) -> None:
        self.key_cache: list[torch.Tensor] = []


def test_a_cache_under_a_field_less_dataclass_is_copied_with_what_it_holds() -> None:
    """Rebuilt from its (no) fields, such a cache would come back empty: a replay of the second
    layer would find no entry for the first."""
    cache = _ListCache()
    cache.key_cache.append(torch.ones(2, 3))
    copied = snapshot({"past_key_value": cache})["past_key_value"]
    assert copied is not cache and len(copied.key_cache) == 1
    assert torch.equal(copied.key_cache[0], cache.key_cache[0])
    cache.key_cache[0].mul_(2)
    assert torch.equal(copied.key_cache[0], torch.ones(2, 3))
