"""Traces hold any tensor a model holds: 0-dim buffers (GPT-2's ``masked_bias`` under
transformers 4.x), bool, integer and complex ones, and non-contiguous or expanded tensors
flowing between modules are digested, recorded and compared without a crash."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import torchparity as tp
from torchparity.diagnosis.core.trace import tensor_digest, weight_digests


class Holder(nn.Module):
    """A linear layer beside buffers of every kind, handing on a transposed and an expanded
    tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("masked_bias", torch.tensor(-1e4))
        self.register_buffer("flag", torch.tensor(True))
        self.register_buffer("count", torch.tensor([3, 4]))
        self.register_buffer("phase", torch.polar(torch.ones(4), torch.arange(4.0)))
        self.register_buffer("causal", torch.ones(4, 4, dtype=torch.bool).tril())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pairs = torch.view_as_complex(torch.stack((x, x.flip(-1)), -1).contiguous())
        rotated = torch.view_as_real(pairs * self.phase).sum(-1)
        keep = rotated.abs() > self.masked_bias
        return self.lin(rotated.t().t()), self.causal.expand(x.shape[0], 4, 4), keep


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Holder(), Holder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden, _, keep = self.first(x)
        out, _, _ = self.second(hidden.t().contiguous().t())
        return out.masked_fill(~keep, 0.0)


@pytest.mark.parametrize("tensor", [
    torch.tensor(-1e4), torch.tensor(True), torch.tensor([3, 4]), torch.tensor(2 + 1j),
    torch.ones(3, 4).t(), torch.ones(1, 3).expand(4, 3), torch.ones(2, dtype=torch.bfloat16),
], ids=["0-dim", "bool", "int", "complex", "transposed", "expanded", "bfloat16"])
def test_a_digest_is_of_the_values_whatever_the_layout(tensor: torch.Tensor) -> None:
    copy = tensor.clone().contiguous()
    assert tensor_digest(tensor) == tensor_digest(copy)
    changed = copy.clone()
    changed.view(-1)[0] = 0 if changed.dtype != torch.bool else ~changed.view(-1)[0]
    assert tensor_digest(changed) != tensor_digest(tensor)


def test_a_model_holding_every_kind_is_recorded_and_diagnosed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, x = Model().eval(), torch.randn(3, 4)
    assert set(weight_digests(model)) >= {"first.masked_bias", "first.phase", "second.flag"}
    trace = tp.record(model, (x,), tmp_path / "base.tptrace")
    report = tp.diagnose_against(trace, model, (x,))
    assert report.first_divergence is None
    with torch.no_grad():
        model.second.lin.weight[0, 0] += 1.0  # a real change is still found
    assert tp.diagnose_against(trace, model, (x,)).first_divergence is not None
