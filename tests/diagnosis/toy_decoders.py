"""A toy decoder written the way NMT toolkits write theirs, and two refactors of its attention.

Each attention module keeps its key/value cache on itself (``self.k_cache``), and the toolkit's
generator hands every layer a step counter, which counts one too far: harmless while the cache
concatenates, as in :class:`SelfAttention`. The refactors (factories ``clean``, ``off_by_one``,
``reordered``; same weights, same prompt, a ``step`` for torchparity's decoding loop):

- :class:`PreallocatedSelfAttention` preallocates the cache in chunks and writes each new
  key/value at the index the counter gives: one slot is never written, and from the first
  decoding step on every layer attends to one extra all-zero key (a real change);
- :class:`ReorderedSelfAttention` only sums the attention-weighted values over the keys in
  reverse order (legitimate rounding noise).

The ``*_twins`` factories give the vocabulary twin tokens (rows of the output projection one
part in 1e7 apart, like a word with and without its leading space), so that greedy choices
between twins are near ties at every step.
"""

from __future__ import annotations

import math

import torch
from torch import nn

VOCAB, DIM, HEADS, LAYERS, BATCH, PROMPT = 32, 32, 2, 2, 8, 10


class SelfAttention(nn.Module):
    """Causal multi-head self-attention returning its output and attention probabilities;
    with a ``step`` it caches keys and values on the module."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, step: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = (t.unflatten(-1, (HEADS, -1)).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        if step is not None:
            k, v = self.cached(k, v, step)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if q.shape[-2] > 1:  # the prompt: each position sees those before it
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        probs = scores.softmax(dim=-1)
        return self.out(self.weighted(probs, v).transpose(1, 2).flatten(-2)), probs

    def weighted(self, probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return probs @ v

    def cached(self, k: torch.Tensor, v: torch.Tensor, step: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if step == 0:
            self.k_cache, self.v_cache = k, v
        else:
            self.k_cache = torch.cat((self.k_cache, k), dim=-2)
            self.v_cache = torch.cat((self.v_cache, v), dim=-2)
        return self.k_cache, self.v_cache


class PreallocatedSelfAttention(SelfAttention):
    """The refactor: keys and values written at index ``step`` into buffers grown 8 at a time."""

    chunk = 8

    def cached(self, k: torch.Tensor, v: torch.Tensor, step: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        stop = step + k.shape[-2]
        if step == 0:
            self.k_cache = self.v_cache = None
        if self.k_cache is None or stop > self.k_cache.shape[-2]:
            size = math.ceil(stop / self.chunk) * self.chunk
            grown = [k.new_zeros(*k.shape[:-2], size, k.shape[-1]) for _ in range(2)]
            if self.k_cache is not None:
                for new, old in zip(grown, (self.k_cache, self.v_cache), strict=True):
                    new[..., :old.shape[-2], :] = old
            self.k_cache, self.v_cache = grown
        self.k_cache[..., step:stop, :] = k
        self.v_cache[..., step:stop, :] = v
        if step == 0:  # the prompt attends to its own keys; later steps read the buffers
            return k, v
        return self.k_cache[..., :stop, :], self.v_cache[..., :stop, :]


class ReorderedSelfAttention(SelfAttention):
    """The other refactor: the weighted sum over the keys taken from the last key to the first."""

    def weighted(self, probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (probs.flip(-1)[..., None] * v.flip(-2)[..., None, :, :]).sum(-2)


class Layer(nn.Module):
    def __init__(self, attention: type[SelfAttention]) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.self_attn = attention()
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor, step: int | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.attn_norm(x), step)[0]
        return x + self.mlp(self.mlp_norm(x))


class ToyDecoder(nn.Module):
    """Token embeddings, causal layers (no positions: the causal mask orders the tokens), norm
    and output projection; ``model(ids, step)`` returns logits (batch, tokens, vocab)."""

    def __init__(self, attention: type[SelfAttention]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer(attention) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, step: int | None = None) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, step)
        return self.lm_head(self.norm(x))


def generate_step(model: ToyDecoder, tokens, state):
    """The toolkit's generator as a torchparity step: the prompt at step 0, then each new token
    with the step counter, which counts the tokens so far plus one (one too far)."""
    if state is None:
        return model(tokens["ids"], step=0), tokens["ids"].shape[1]
    return model(tokens, step=state + 1), state + 1


def make(attention: type[SelfAttention] = SelfAttention, twins: bool = False,
         decoder: type[ToyDecoder] = ToyDecoder) -> dict:
    torch.manual_seed(0)
    model = decoder(attention).eval()
    with torch.no_grad():  # attention weighs in the residual stream as in a trained model
        for layer in model.layers:
            layer.self_attn.out.weight.mul_(4)
    if twins:
        with torch.no_grad():  # odd rows one part in 1e7 from the even ones
            model.lm_head.weight[1::2] = model.lm_head.weight[0::2] * (1 + 1e-7)
    ids = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    return {"model": model, "inputs": {"ids": ids}, "step": generate_step}


def clean() -> dict:
    return make(SelfAttention)


def off_by_one() -> dict:
    return make(PreallocatedSelfAttention)


def reordered() -> dict:
    return make(ReorderedSelfAttention)


def clean_twins() -> dict:
    return make(SelfAttention, twins=True)


def off_by_one_twins() -> dict:
    return make(PreallocatedSelfAttention, twins=True)


def reordered_twins() -> dict:
    return make(ReorderedSelfAttention, twins=True)
