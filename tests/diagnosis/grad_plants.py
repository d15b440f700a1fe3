"""A small user-style model whose activation is one module, and changes of it that show in
gradients: a custom ``autograd.Function`` whose backward alone is off, tanh GELU for exact
GELU (its forward changes, and its backward with it), GELU shifted (its forward changes, its
backward does not), and an exact rewrite of the same math.

The lines the answers should name are marked ``# planted``; the tests read them from this
file's source, independently of the diagnosis.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class ScaledGelu(torch.autograd.Function):
    """Exact GELU forward; its backward 2% off."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        cdf = 0.5 * (1 + torch.erf(x / math.sqrt(2)))
        pdf = torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        return grad * (cdf + x * pdf) * 1.02  # planted


class Gelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


class GeluCustomBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ScaledGelu.apply(x)


class GeluTanh(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")  # planted


class GeluShifted(nn.Module):
    """Exact GELU moved up: its own backward is A's, the next linear's weight gradient is not."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x) + 0.05  # planted


class GeluRewritten(nn.Module):
    """Exact GELU written out: the same math, other ops."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 * (1 + torch.erf(x * (1 / math.sqrt(2))))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.act = Gelu()
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class TinyNet(nn.Module):
    def __init__(self, vocab: int = 32, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make_a() -> tuple:
    torch.manual_seed(0)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    return TinyNet(), (ids,)


def _with_act(act: type[nn.Module]) -> tuple:
    model, inputs = make_a()
    model.blocks[1].act = act()
    return model, inputs


def make_b_custom_backward() -> tuple:
    return _with_act(GeluCustomBackward)


def make_b_tanh() -> tuple:
    return _with_act(GeluTanh)


def make_b_shifted() -> tuple:
    return _with_act(GeluShifted)


def make_b_rewritten() -> tuple:
    return _with_act(GeluRewritten)
