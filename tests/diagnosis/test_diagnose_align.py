"""Alignment of A's and B's modules: names, name maps, call order and shapes, fusion."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchparity as tp
from torchparity.diagnosis.core.align import align, name_translator
from torchparity.diagnosis.core.capture import Capture

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 4)
        self.v = nn.Linear(8, 4)
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.cat([self.q(x), self.k(x), self.v(x)], -1).tanh())


class RenamedBlock(nn.Module):
    """The same computation with every submodule renamed."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Linear(8, 8)
        self.key = nn.Linear(8, 4)
        self.value = nn.Linear(8, 4)
        self.proj = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = torch.cat([self.query(x), self.key(x), self.value(x)], -1)
        return x + self.proj(qkv.tanh())


class FusedBlock(nn.Module):
    """q, k and v in one matmul."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.qkv(x).tanh())


class Net(nn.Module):
    def __init__(self, block: type[nn.Module] = Block, extra: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([block(), block()])
        self.extra = nn.Identity() if extra else None
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        if self.extra is not None:
            x = self.extra(x)
        return self.head(x)


def copy_weights(source: Net, target: Net) -> Net:
    """Give ``target`` the same function as ``source`` (weights in call order, fused by rows)."""
    with torch.no_grad():
        for src, dst in zip(source.blocks, target.blocks, strict=True):
            if isinstance(dst, FusedBlock):
                dst.qkv.weight.copy_(torch.cat([src.q.weight, src.k.weight, src.v.weight]))
                dst.qkv.bias.copy_(torch.cat([src.q.bias, src.k.bias, src.v.bias]))
                dst.out.load_state_dict(src.out.state_dict())
            else:
                for s, d in zip(src.parameters(), dst.parameters(), strict=True):
                    d.copy_(s)
        target.head.load_state_dict(source.head.state_dict())
    return target


def calls(model: nn.Module) -> list:
    with Capture(model, what="shapes") as cap:
        model(torch.randn(2, 3, 8))
    return cap.records


def keys(matches) -> list[tuple[str, str, str]]:
    return [(m.a_name, m.b_name, m.how) for m in matches]


def test_exact_names_align_one_to_one() -> None:
    alignment = align(calls(Net()), calls(Net()))
    assert all(m.how == "name" and m.a_name == m.b_name for m in alignment.matches)
    assert len(alignment.matches) == len(calls(Net()))
    assert not alignment.unmatched_a and not alignment.unmatched_b


def test_renamed_modules_align_by_order_and_shape() -> None:
    alignment = align(calls(Net()), calls(Net(RenamedBlock)))
    assert ("blocks.0.q", "blocks.0.query", "order") in keys(alignment.matches)
    assert ("blocks.1.out", "blocks.1.proj", "order") in keys(alignment.matches)
    assert ("blocks.1", "blocks.1", "name") in keys(alignment.matches)
    assert not alignment.unmatched_a and not alignment.unmatched_b


def test_name_map_dict_and_regex() -> None:
    as_dict = {f"blocks.{i}.{a}": f"blocks.{i}.{b}" for i in range(2)
               for a, b in [("q", "query"), ("k", "key"), ("v", "value"), ("out", "proj")]}
    as_regex = [(r"(blocks\.\d+)\.q", r"\1.query"), (r"(blocks\.\d+)\.k", r"\1.key"),
                (r"(blocks\.\d+)\.v", r"\1.value"), (r"(blocks\.\d+)\.out", r"\1.proj")]
    for name_map in (as_dict, as_regex):
        alignment = align(calls(Net()), calls(Net(RenamedBlock)), name_map, by_order=False)
        assert ("blocks.0.k", "blocks.0.key", "name_map") in keys(alignment.matches)
        assert not alignment.unmatched_a and not alignment.unmatched_b
    assert name_translator(as_regex)("blocks.12.v") == "blocks.12.value"
    assert name_translator(as_regex)("head") == "head"


def test_fused_module_aligns_with_the_concatenation_of_its_parts() -> None:
    alignment = align(calls(Net()), calls(Net(FusedBlock)))
    assert ("blocks.0.q+blocks.0.k+blocks.0.v", "blocks.0.qkv", "fused") in keys(alignment.matches)
    split = align(calls(Net(FusedBlock)), calls(Net()))  # the other way round: a split module
    assert ("blocks.1.qkv", "blocks.1.q+blocks.1.k+blocks.1.v", "fused") in keys(split.matches)
    assert not alignment.unmatched_a and not alignment.unmatched_b


def test_unmatched_modules_are_listed_not_dropped() -> None:
    alignment = align(calls(Net()), calls(Net(extra=True)), by_order=False)
    assert [c.key for c in alignment.unmatched_b] == ["extra"]
    assert not alignment.unmatched_a


def test_diagnose_of_renamed_and_fused_twins_finds_no_divergence() -> None:
    torch.manual_seed(0)
    net = Net()
    x = (torch.randn(2, 5, 8),)
    for block in (RenamedBlock, FusedBlock):
        report = tp.diagnose(net, copy_weights(net, Net(block)), x)
        assert report.first_divergence is None and report.first_grad_divergence is None
        assert report.output.ok
        assert not report.unmatched_a and not report.unmatched_b
        assert {r.how for r in report.rows} >= {"name", "fused" if block is FusedBlock else "order"}


def test_diagnose_reports_unmatched_modules() -> None:
    torch.manual_seed(0)
    net, bigger = Net(), Net(extra=True)
    bigger.load_state_dict(net.state_dict())
    report = tp.diagnose(net, bigger, (torch.randn(2, 5, 8),), backward=False)
    assert report.unmatched_b == ["extra"]
    assert "unmatched in B: extra" in report.render()
