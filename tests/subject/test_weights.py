"""tp.init_weights and tp.random_tensor: the usual scales per kind of layer, tied weights kept
tied, and the same values under every instruction set, where torch's own draw differs."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

import torchparity as tp
from torchparity import machine
from torchparity.reference import rng

SQRT3 = math.sqrt(3.0)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 128)
        self.down = nn.Linear(128, 32, bias=False)
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight
        self.batch_norm = nn.BatchNorm1d(32)
        self.register_buffer("table", torch.full((4,), -1.0), persistent=False)


def test_each_kind_of_tensor_gets_its_scale() -> None:
    model = tp.init_weights(TinyLM(), seed=0)
    # Uniform values: std s spans [-sqrt(3) s, sqrt(3) s] around the mean; each tensor is the
    # seeded uniform draw of its name, at its kind's scale, to the bit.
    for name, mean, std in (("norm.weight", 1.0, 0.05), ("norm.bias", 0.0, 0.05),
                            ("batch_norm.running_var", 1.0, 0.05),
                            ("embed.weight", 0.0, 0.02), ("up.bias", 0.0, 0.02),
                            ("up.weight", 0.0, 1 / math.sqrt(32)),
                            ("down.weight", 0.0, 1 / math.sqrt(128))):
        tensor = model.state_dict()[name]
        assert (tensor - mean).abs().max() <= SQRT3 * std
        drawn = rng.symmetric(0, name, tensor.shape, std) + mean
        assert torch.equal(tensor, drawn.to(tensor.dtype)), name
    assert model.head.weight is model.embed.weight
    assert model.batch_norm.num_batches_tracked.item() == 0  # integers are left alone
    assert torch.equal(model.table, torch.full((4,), -1.0))  # the module recomputes it


def test_values_depend_on_the_seed_and_the_name_alone() -> None:
    a, b = tp.init_weights(TinyLM(), seed=3), tp.init_weights(TinyLM().double(), seed=3)
    assert all(torch.equal(x, y.float()) for x, y in zip(a.state_dict().values(),
                                                        b.state_dict().values(), strict=True))
    other = tp.init_weights(TinyLM(), seed=4)
    assert not torch.equal(a.up.weight, other.up.weight)
    x, y = tp.random_tensor((2, 8), seed=1), tp.random_tensor((2, 8), seed=1, stream="other")
    assert x.dtype == torch.float32 and not torch.equal(x, y)
    assert x.abs().max() <= SQRT3


_DRAW = """
import torch, torchparity as tp
from torch import nn
model = tp.init_weights(nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64)), seed=0)
ours = torch.cat([t.flatten() for t in model.state_dict().values()]
                 + [tp.random_tensor((1000,), seed=0)])
torch.manual_seed(0)
print(torch.backends.cpu.get_cpu_capability(), ours.double().sum().item().hex(),
      torch.empty(1000).normal_().double().sum().item().hex())
"""


def test_the_same_values_under_every_instruction_set() -> None:
    # torch's normal_ draws differently under the lowest and the highest instruction set:
    # the control that shows the two processes really dispatched different kernels.
    lowest, highest = machine.capabilities()[0], machine.capabilities()[-1]
    if lowest == highest:
        pytest.skip("this CPU dispatches one instruction set only")
    runs = [subprocess.run([sys.executable, "-c", _DRAW], env=machine.environment(capability),
                           capture_output=True, text=True, check=True).stdout.split()
            for capability in (lowest, highest)]
    assert [run[0].lower() for run in runs] == [lowest, highest]
    assert runs[0][1] == runs[1][1]
    assert runs[0][2] != runs[1][2]
