"""A stand-in for eole's LM test model (``eole/tests/test_model_lm``: 2 layers, 2 heads, hidden
64, feed-forward 256, biases on), written the way eole writes it before and after its
refactor of the self-attention's cache (base b5e2266, pull request 8a8987f), random weights.

What the refactor changed, kept here as eole has it:

- ``sliding_window`` stops being a keyword argument of ``SelfMHA.forward`` (the layer passed its
  own value, 0) and becomes an attribute the module reads, ``self.sliding_window``, set from
  the same config: the same value, no change of meaning;
- the mask keyword ``mask`` (True: masked) becomes ``attn_mask`` (True: attended), None at
  every decoding step on both sides;
- the KV cache the module keeps on itself, ``self.layer_cache = (bool, {"keys": ...,
  "values": ..., "key_pad_mask": ...})``, is no longer concatenated but preallocated 32
  positions at a time and written at the index of the generator's ``step``, which counts the
  prompt and the steps so far plus one (``step + max(src_len)``): one position is never
  written, and from the first decoding step on every layer attends to an all-zero key.

Factories (same weights, same prompt, a ``step`` for torchparity's decoding loop): ``base``,
``pull_request``, and ``pull_request_concatenating`` (the pull request with only the cache
write reverted to the base's concatenation).
"""

from __future__ import annotations

import math

import torch
from torch import nn

VOCAB, HIDDEN, FF, HEADS, LAYERS, BATCH, PROMPT = 96, 64, 256, 2, 2, 4, 9


def shape(x: torch.Tensor) -> torch.Tensor:
    """(batch, length, hidden) -> (batch, heads, length, dim per head)."""
    return x.view(x.shape[0], x.shape[1], HEADS, -1).transpose(1, 2)


def unshape(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).reshape(x.shape[0], -1, HIDDEN)


class SelfMHA(nn.Module):
    """eole's self-attention at base: ``sliding_window`` and a ``mask`` (True: masked) are
    keyword arguments, the cache is concatenated."""

    def __init__(self, sliding_window: int = 0) -> None:
        super().__init__()
        self.linear_keys = nn.Linear(HIDDEN, HIDDEN)
        self.linear_values = nn.Linear(HIDDEN, HIDDEN)
        self.linear_query = nn.Linear(HIDDEN, HIDDEN)
        self.final_linear = nn.Linear(HIDDEN, HIDDEN)
        self.layer_cache = (False, {"keys": torch.tensor([]), "values": torch.tensor([]),
                                    "key_pad_mask": None})

    def forward(self, query: torch.Tensor, mask: torch.Tensor | None = None,
                sliding_window: int | None = 0, step: int | None = 0,
                return_attn: bool | None = False) -> tuple[torch.Tensor, torch.Tensor]:
        key, value, query = (shape(self.linear_keys(query)), shape(self.linear_values(query)),
                             shape(self.linear_query(query)))
        if self.layer_cache[0]:
            key, value = self._prepare_inputs_w_cache(key, value, step, sliding_window)
        return self._compute_attention(key, value, query, None if mask is None else ~mask)

    def _prepare_inputs_w_cache(self, key: torch.Tensor, value: torch.Tensor, step: int,
                                sliding_window: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.layer_cache[1]
        if cache["keys"].numel() != 0:
            key = torch.cat((cache["keys"], key), dim=2)
            value = torch.cat((cache["values"], value), dim=2)
            if sliding_window > 0 and key.size(2) > sliding_window:
                key, value = key[:, :, 1:, :], value[:, :, 1:, :]
        cache["keys"], cache["values"] = key, value
        return key, value

    def _compute_attention(self, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor,
                           attended: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = (query / math.sqrt(query.shape[-1])) @ key.transpose(2, 3)
        if attended is not None:
            scores = scores.masked_fill(~attended.expand(-1, HEADS, -1, -1), -1e18)
        attn = scores.float().softmax(dim=-1).to(query.dtype)
        return self.final_linear(unshape(attn @ value)), attn


class PullRequestSelfMHA(SelfMHA):
    """The pull request: ``self.sliding_window``, ``attn_mask`` (True: attended) and the cache
    preallocated 32 positions at a time, written at index ``step``."""

    def __init__(self, sliding_window: int = 0) -> None:
        super().__init__()
        self.sliding_window = sliding_window

    def forward(self, query: torch.Tensor, attn_mask: torch.Tensor | None = None,
                step: int | None = 0, return_attn: bool | None = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        key, value, query = (shape(self.linear_keys(query)), shape(self.linear_values(query)),
                             shape(self.linear_query(query)))
        if self.layer_cache[0]:
            key, value = self._prepare_inputs_w_cache(key, value, step, self.sliding_window)
        return self._compute_attention(key, value, query, attn_mask)

    def _expand_cache(self, add_length: int, step: int) -> int:
        cache = self.layer_cache[1]
        b, h, length, dph = cache["keys"].shape
        if step >= length:
            for part in ("keys", "values"):
                cache[part] = torch.cat((cache[part], cache[part].new_zeros(b, h, add_length,
                                                                            dph)), dim=2)
        if self.sliding_window > 0 and length > self.sliding_window:
            for part in ("keys", "values"):
                cache[part] = cache[part][:, :, 1:, :]
            return self.sliding_window
        return step

    def _prepare_inputs_w_cache(self, key: torch.Tensor, value: torch.Tensor, step: int,
                                sliding_window: int) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.layer_cache[1]
        if step == 0:
            cache["keys"], cache["values"] = key, value
            return key, value
        cache_len = self._expand_cache(32, step)
        cache["keys"][:, :, cache_len, :] = key[:, :, 0, :]
        cache["values"][:, :, cache_len, :] = value[:, :, 0, :]
        return cache["keys"][:, :, :cache_len + 1, :], cache["values"][:, :, :cache_len + 1, :]


class ConcatenatingPullRequestSelfMHA(PullRequestSelfMHA):
    """The pull request with only the cache write reverted: concatenated as at base."""

    _prepare_inputs_w_cache = SelfMHA._prepare_inputs_w_cache


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(HIDDEN, FF)
        self.down_proj = nn.Linear(FF, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.gate_up_proj(x)))


class TransformerLMDecoderLayer(nn.Module):
    def __init__(self, attention: type[SelfMHA]) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attn = attention()
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = MLP()
        self.sliding_window = 0

    def forward(self, layer_in: torch.Tensor, pad_mask: torch.Tensor, step: int | None = None
                ) -> torch.Tensor:
        masked = None
        if layer_in.size(1) > 1:  # the prompt in one shot: padding and future masked
            length = pad_mask.size(-1)
            future = torch.ones(length, length, dtype=torch.bool).tril()
            masked = (pad_mask | ~future.unsqueeze(0)).unsqueeze(1)
        norm_layer_in = self.input_layernorm(layer_in)
        if isinstance(self.self_attn, PullRequestSelfMHA):
            attn_output, _ = self.self_attn(norm_layer_in,
                                            attn_mask=None if masked is None else ~masked,
                                            step=step)
        else:
            attn_output, _ = self.self_attn(norm_layer_in, mask=masked,
                                            sliding_window=self.sliding_window, step=step)
        ff_in = self.post_attention_layernorm(attn_output + layer_in)
        return self.mlp(ff_in) + layer_in + attn_output


class TransformerLMDecoder(nn.Module):
    def __init__(self, attention: type[SelfMHA]) -> None:
        super().__init__()
        self.transformer_layers = nn.ModuleList(
            TransformerLMDecoderLayer(attention) for _ in range(LAYERS))
        self.layer_norm = nn.LayerNorm(HIDDEN)

    def forward(self, emb: torch.Tensor, tgt_pad_mask: torch.Tensor, step: int | None = None
                ) -> torch.Tensor:
        if step == 0:  # decoding starts: each attention's cache is enabled, empty
            for layer in self.transformer_layers:
                layer.self_attn.layer_cache = (True, {"keys": torch.tensor([]),
                                                      "values": torch.tensor([]),
                                                      "key_pad_mask": tgt_pad_mask})
        for layer in self.transformer_layers:
            emb = layer(emb, tgt_pad_mask, step=step)
        return self.layer_norm(emb)


class Embeddings(nn.Module):
    """Word embeddings plus sinusoidal positions from ``step`` on."""

    def __init__(self) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, HIDDEN, padding_idx=1)
        position = torch.arange(512.0)[:, None]
        rate = torch.exp(torch.arange(0, HIDDEN, 2.0) * -(math.log(10000.0) / HIDDEN))
        pe = torch.zeros(512, HIDDEN)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * rate), torch.cos(position * rate)
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, ids: torch.Tensor, step: int | None = None) -> torch.Tensor:
        start = step or 0
        return self.embeddings(ids) * math.sqrt(HIDDEN) + self.pe[start:start + ids.shape[1]]


class LanguageModel(nn.Module):
    def __init__(self, attention: type[SelfMHA]) -> None:
        super().__init__()
        self.tgt_emb = Embeddings()
        self.decoder = TransformerLMDecoder(attention)
        self.generator = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, step: int | None = None) -> torch.Tensor:
        pad_mask = (ids == 1).unsqueeze(1)
        return self.generator(self.decoder(self.tgt_emb(ids, step=step), pad_mask, step=step))


def generate_step(model: LanguageModel, tokens, state):
    """eole's generator as a torchparity step: the prompt at step 0, then each new token with
    ``step + max(src_len)``."""
    if state is None:
        ids = tokens["ids"]
        return model(ids, step=0), {"length": ids.shape[1], "step": 0}
    step = state["step"] + 1
    return model(tokens, step=step + state["length"]), {**state, "step": step}


def make(attention: type[SelfMHA]) -> dict:
    torch.manual_seed(0)
    model = LanguageModel(attention).eval()
    ids = torch.randint(4, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    return {"model": model, "inputs": {"ids": ids}, "step": generate_step}


def base() -> dict:
    return make(SelfMHA)


def pull_request() -> dict:
    return make(PullRequestSelfMHA)


def pull_request_concatenating() -> dict:
    return make(ConcatenatingPullRequestSelfMHA)
