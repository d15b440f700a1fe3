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


class BiasedAttention(MaskedAttention):
    def forward(self, x, attention_mask, bias):
        return super().forward(x + bias, attention_mask)


class MovedBiasAttention(MaskedAttention):
    """:class:`BiasedAttention` with its mask renamed and moved after the bias: which
    parameter A's ``attention_mask`` became is not sure from the names and positions."""

    def forward(self, x, bias, mask):
        return super().forward(x + bias, mask)


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


class RowPickingAttention(nn.Module):
    """Attention over ``x`` whose mask covers every position of a static cache; with
    ``picks``, its rows and keys are picked by ``cache_position`` (transformers 4.38's
    ``attention_mask[:, :, cache_position, :keys]``), without, the mask is already one row per
    query and one column per key (4.39's)."""

    def __init__(self, picks: bool) -> None:
        super().__init__()
        self.proj, self.picks = nn.Linear(DIM, DIM), picks

    def forward(self, x, mask, cache_position=None):
        if self.picks:
            mask = mask[:, cache_position, :x.shape[-2]]
        scores = x @ self.proj(x).transpose(-1, -2)
        return (scores + mask).softmax(-1) @ x


class SquareCachedMask(nn.Module):
    """A (``revised=False``) hands its attention a causal mask over ``positions`` queries and
    keys, and the queries' ``cache_position``; B one over the sequence."""

    def __init__(self, revised: bool, positions: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(DIM, DIM)
        self.attn, self.positions, self.revised = RowPickingAttention(not revised), positions, \
            revised
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x):
        length = x.shape[-2]
        size = length if self.revised else self.positions
        mask = torch.full((1, size, size), float("-inf")).triu(1)
        return self.head(self.attn(self.pre(x), mask, cache_position=torch.arange(length)))
