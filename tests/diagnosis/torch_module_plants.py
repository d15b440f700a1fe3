"""Models whose one change lies inside a module of torch's own (``nn.LayerNorm``,
``nn.RMSNorm``, ``nn.Embedding``, ``nn.Linear``): B's block builds the module with other
arguments, each such line marked ``# planted``; its forward is A's, line for line."""

from __future__ import annotations

import torch
from torch import nn

WIDTH, VOCAB = 16, 32


class Block(nn.Module):
    def __init__(self, d: int = WIDTH) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d)
        self.ln1 = nn.RMSNorm(d, eps=1e-6)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)
        self.ln2 = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        h = self.down(torch.relu(self.up(self.ln1(x))))
        return self.ln2(x + h)


class LayerNormEps(Block):
    def __init__(self, d: int = WIDTH) -> None:
        super().__init__(d)
        self.ln2 = nn.LayerNorm(d, eps=1e-3)  # planted


class RMSNormEps(Block):
    def __init__(self, d: int = WIDTH) -> None:
        super().__init__(d)
        self.ln1 = nn.RMSNorm(d, eps=1e-1)  # planted


class EmbeddingMaxNorm(Block):
    def __init__(self, d: int = WIDTH) -> None:
        super().__init__(d)
        self.embed = nn.Embedding(VOCAB, d, max_norm=1.0)  # planted


class LinearNoBias(Block):
    def __init__(self, d: int = WIDTH) -> None:
        super().__init__(d)
        self.down = nn.Linear(2 * d, d, bias=False)  # planted


def pair(plant: type) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    """A's block and B's (``plant``) with the same weights where both have them, and ids."""
    torch.manual_seed(0)
    model_a, model_b = Block(), plant()
    model_b.load_state_dict(model_a.state_dict(), strict=False)
    ids = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    return model_a, model_b, ids


def make_a() -> tuple:
    """A's block and its ids, as an entry of the command line."""
    model_a, _, ids = pair(Block)
    return model_a, (ids,)


def make_b_layer_norm() -> tuple:
    """B's block, its ``ln2`` built with ``eps=1e-3``, as an entry of the command line."""
    _, model_b, ids = pair(LayerNormEps)
    return model_b, (ids,)
