"""Two revisions of a tiny decoder whose layers hand their attention the mask in another
convention, as two transformers releases do.

A's model hands each attention the padding mask, ``(batch, 1, 1, keys)`` bool, and the
attention builds the causal mask inside. B's model hands ``None`` where nothing is padded,
and B's attention then asks SDPA for ``is_causal=True``; a mask it is handed it takes as the
whole mask. Both compute the same thing on their own inputs; B's attention fed A's padding mask
attends to later keys. ``changed_layer``: B's MLP of that layer takes the tanh approximation of
GELU, a change of its own arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import torchparity as tp

VOCAB, WIDTH, HEADS, LAYERS = 32, 16, 2, 3


class Attention(nn.Module):
    def __init__(self, revised: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.revised = revised

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (t.view(batch, length, HEADS, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        if self.revised:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask,
                                               is_causal=attention_mask is None)
        else:
            causal = torch.ones(length, length, dtype=torch.bool).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask & causal)
        return self.out(y.transpose(1, 2).reshape(batch, length, WIDTH))


class MLP(nn.Module):
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate=self.approximate))


class Layer(nn.Module):
    def __init__(self, revised: bool, approximate: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = Attention(revised)
        self.mlp = MLP(approximate)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), attention_mask)
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, revised: bool, changed_layer: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(
            Layer(revised, "tanh" if i == changed_layer else "none") for i in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.revised = revised

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        padding = attention_mask.bool()[:, None, None, :]
        handed = None if self.revised and bool(padding.all()) else padding
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, attention_mask=handed)
        return self.head(x)


def inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def pair(changed_layer: int | None) -> tuple[nn.Module, nn.Module]:
    """A and B with the same weights; B's convention, and its MLP of ``changed_layer``."""
    a = tp.init_weights(Decoder(revised=False), seed=0).eval()
    b = Decoder(revised=True, changed_layer=changed_layer).eval()
    b.load_state_dict(a.state_dict())
    return a, b
