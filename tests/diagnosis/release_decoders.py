"""One tiny decoder written as two releases of a library write it, the way ``transformers`` 4.x
and 5.x differ, with the same weights and prompt (a ``step`` for torchparity's decoding loop).

- ``old``: the attention takes ``past_key_value``, an ``nn.Module`` cache holding
  ``key_cache[i]`` / ``value_cache[i]`` (4.x's ``DynamicCache``), and is also handed
  ``output_attentions=False`` (its default) and a ``cache_position`` it does not need;
- ``new``: the attention takes ``past_key_values``, a plain cache object holding
  ``layers[i].keys`` / ``.values`` (5.x), and nothing else;
- ``new_scaled``: ``new`` with a bug in its cached path only (the query of a single new token
  scaled by 1.05): the module's own code, with its arguments and cache as A's;
- ``new_stale``: ``new`` whose cache keeps one never-written, all-zero position before each
  new token: the change enters through the cache.
"""

from __future__ import annotations

import math

import torch
from torch import nn

VOCAB, DIM, HEADS, LAYERS, BATCH, PROMPT = 32, 32, 2, 2, 4, 6


class OldCache(nn.Module):
    """4.x: lists of tensors per layer, on an ``nn.Module``."""

    def __init__(self) -> None:
        super().__init__()
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.key_cache) <= layer:
            self.key_cache.append(k)
            self.value_cache.append(v)
        else:
            self.key_cache[layer] = torch.cat((self.key_cache[layer], k), dim=-2)
            self.value_cache[layer] = torch.cat((self.value_cache[layer], v), dim=-2)
        return self.key_cache[layer], self.value_cache[layer]


class CacheLayer:
    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None


class NewCache:
    """5.x: one object per layer holding ``keys`` and ``values``."""

    stale = False

    def __init__(self) -> None:
        self.layers = [CacheLayer() for _ in range(LAYERS)]

    def update(self, k: torch.Tensor, v: torch.Tensor, layer: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        held = self.layers[layer]
        if held.keys is None:
            held.keys, held.values = k, v
        else:
            gap = [k.new_zeros(k.shape)] if self.stale else []
            held.keys = torch.cat((held.keys, *gap, k), dim=-2)
            held.values = torch.cat((held.values, *gap, v), dim=-2)
        return held.keys, held.values


class StaleCache(NewCache):
    stale = True


class Attention(nn.Module):
    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(DIM, DIM)
                                                              for _ in range(4))

    def attend(self, x: torch.Tensor, cache) -> torch.Tensor:
        q, k, v = (proj(x).unflatten(-1, (HEADS, -1)).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        k, v = cache.update(k, v, self.layer)
        q = self.scaled(q)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if q.shape[-2] > 1:
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        return self.o_proj((scores.softmax(-1) @ v).transpose(1, 2).flatten(-2))

    def scaled(self, q: torch.Tensor) -> torch.Tensor:
        return q


class OldAttention(Attention):
    def forward(self, x: torch.Tensor, past_key_value: OldCache | None = None,
                output_attentions: bool = False, cache_position: torch.Tensor | None = None
                ) -> tuple[torch.Tensor]:
        return (self.attend(x, past_key_value),)


class NewAttention(Attention):
    def forward(self, x: torch.Tensor, past_key_values: NewCache | None = None, **kwargs
                ) -> torch.Tensor:
        return self.attend(x, past_key_values)


class ScaledAttention(NewAttention):
    def scaled(self, q: torch.Tensor) -> torch.Tensor:
        return q * 1.05 if q.shape[-2] == 1 else q


class Layer(nn.Module):
    def __init__(self, attention: type[Attention], layer: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.self_attn = attention(layer)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor, cache, position: torch.Tensor):
        if isinstance(self.self_attn, OldAttention):
            x = x + self.self_attn(self.norm(x), past_key_value=cache, output_attentions=False,
                                   cache_position=position)[0]
            return (x + self.mlp(x),)  # 4.x layers return a tuple
        x = x + self.self_attn(self.norm(x), past_key_values=cache)
        return x + self.mlp(x)


class Decoder(nn.Module):
    def __init__(self, attention: type[Attention]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer(attention, i) for i in range(LAYERS))
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, cache, start: int) -> torch.Tensor:
        x = self.embed(ids)
        position = torch.arange(start, start + ids.shape[1])
        for layer in self.layers:
            x = layer(x, cache, position)
            x = x[0] if isinstance(x, tuple) else x
        return self.lm_head(x)


def make(attention: type[Attention], cache: type) -> dict:
    torch.manual_seed(0)
    model = Decoder(attention).eval()
    with torch.no_grad():  # attention weighs in the residual stream as in a trained model
        for layer in model.layers:
            layer.self_attn.o_proj.weight.mul_(4)

    def step(model, tokens, state):
        if state is None:
            fresh = cache()
            return model(tokens["ids"], fresh, 0), (fresh, tokens["ids"].shape[1])
        held, length = state
        return model(tokens, held, length), (held, length + 1)

    ids = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    return {"model": model, "inputs": {"ids": ids}, "step": step}


def old() -> dict:
    return make(OldAttention, OldCache)


def new() -> dict:
    return make(NewAttention, NewCache)


def new_scaled() -> dict:
    return make(ScaledAttention, NewCache)


def new_stale() -> dict:
    return make(NewAttention, StaleCache)
