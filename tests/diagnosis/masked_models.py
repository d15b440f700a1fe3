"""Two revisions of a model whose attention takes its mask in another shape.

A's caller sizes the additive mask to a preallocated cache of ``keys`` positions and A's
attention takes the first ones; B's caller sizes it to the sequence. ``spare`` is what A's mask
holds past the sequence: ``-inf`` (masked for every query, as a static cache's mask) or 0
(attended, which A's attention ignores but no replay of B may assume). The caller hands the
mask by position, or by ``keyword`` (with ``also``, more keyword arguments), to an ``attention``
whose forward may name its parameters otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM = 16, 8


class MaskedAttention(nn.Module):
    def __init__(self, sliced: bool) -> None:
        super().__init__()
        self.proj, self.sliced = nn.Linear(DIM, DIM), sliced

    def forward(self, x, mask):
        scores = x @ self.proj(x).transpose(-1, -2)
        scores = scores + (mask[..., :x.shape[-2]] if self.sliced else mask)
        return scores.softmax(-1) @ x


class RenamedMaskAttention(MaskedAttention):
    """The same attention, its mask parameter named ``attention_mask``."""

    def forward(self, x, attention_mask):
        return super().forward(x, attention_mask)


class TemperedAttention(MaskedAttention):
    """The same attention with a new parameter no older caller passes."""

    def forward(self, x, mask, temperature):
        return super().forward(x / temperature, mask)


class CachedMask(nn.Module):
    def __init__(self, revised: bool, keys: int = 16, spare: float = float("-inf"),
                 attention: type[MaskedAttention] = MaskedAttention, keyword: str | None = None,
                 also: dict | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(DIM, DIM)
        self.attn, self.keys, self.revised = attention(not revised), keys, revised
        self.head = nn.Linear(DIM, VOCAB)
        self.spare, self.keyword, self.also = spare, keyword, also or {}

    def forward(self, x):
        length = x.shape[-2]
        width = length if self.revised else self.keys
        mask = torch.full((length, width), float("-inf")).triu(1)
        mask[:, length:] = self.spare
        hidden = self.pre(x)
        if self.keyword is None:
            return self.head(self.attn(hidden, mask))
        return self.head(self.attn(hidden, **{self.keyword: mask}, **self.also))
