"""Attention modules as a user writes them, each beside its refactor: correct twins and twins
with a planted bug. Classes sit at the top of the file so that reproducers can name them.

Every module takes ``hidden_states`` (batch, seq, d_model) and optional ``attention_mask``
(batch, keys), 1 for a real token and 0 for padding (the Hugging Face convention), and is
causal; the decoding ones take a ``cache`` and decode chunk by chunk.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def allowed(attention_mask: torch.Tensor | None, q_len: int, k_len: int,
            device: torch.device) -> torch.Tensor:
    """(batch or 1, 1, q, k) bool, True where a query may attend: causal with the queries at
    the end of the keys, and real keys only."""
    offset = k_len - q_len
    causal = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(offset)
    if attention_mask is None:
        return causal[None, None]
    return causal[None, None] & attention_mask.bool()[:, None, None, :]


def softmax_attention(q, k, v, allow: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain attention; a query that may attend to nothing gets zeros."""
    scores = (q @ k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(~allow, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs @ v


class Heads(nn.Module):
    """What all the attention modules below share: sizes and the head split."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 rotary: bool = False) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads or n_heads
        self.head_dim = d_model // n_heads
        self.rotary = rotary
        self.o = nn.Linear(n_heads * self.head_dim, d_model, bias=False)

    def split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, heads, self.head_dim).transpose(1, 2)

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        b, _, s, _ = x.shape
        return self.o(x.transpose(1, 2).reshape(b, s, -1))

    def inv_freq(self) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        return 1.0 / 10000 ** exponents

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype):
        """(batch, 1, seq, head_dim / 2) cosines and sines in ``dtype``, computed in float32
        (Llama's): positions past 256 are not integers in bf16."""
        angles = (position_ids.float()[..., None] * self.inv_freq())[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def rotate_half(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Llama's layout: the first half of a head pairs with the second half."""
        cos, sin = self.cos_sin(position_ids, x.dtype)
        cos, sin = cos.repeat(1, 1, 1, 2), sin.repeat(1, 1, 1, 2)
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-second, first), dim=-1) * sin

    def positions(self, hidden_states, position_ids):
        if position_ids is None:
            return torch.arange(hidden_states.shape[1])[None]
        return position_ids


class ThreeProjectionAttention(Heads):
    """The original: separate query, key and value projections, attention written out."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 rotary: bool = False) -> None:
        super().__init__(d_model, n_heads, n_kv_heads, rotary)
        self.q = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.k = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        q = self.split(self.q(hidden_states), self.n_heads)
        k = self.split(self.k(hidden_states), self.n_kv_heads)
        v = self.split(self.v(hidden_states), self.n_kv_heads)
        if self.rotary:
            positions = self.positions(hidden_states, position_ids)
            q, k = self.rotate_half(q, positions), self.rotate_half(k, positions)
        k, v = self.repeat_kv(k), self.repeat_kv(v)
        allow = allowed(attention_mask, q.shape[2], k.shape[2], q.device)
        return self.merge(softmax_attention(q, k, v, allow, 1 / math.sqrt(self.head_dim)))

    def repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        """Each key/value head serves the query heads of its group, in order."""
        return x.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1)


class FusedQKVAttention(Heads):
    """The refactor: one fused projection, attention by scaled_dot_product_attention."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None,
                 rotary: bool = False) -> None:
        super().__init__(d_model, n_heads, n_kv_heads, rotary)
        self.sizes = [n_heads * self.head_dim] + [self.n_kv_heads * self.head_dim] * 2
        self.qkv = nn.Linear(d_model, sum(self.sizes), bias=False)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        q, k, v = self.qkv(hidden_states).split(self.sizes, dim=-1)
        q, k, v = (self.split(t, h) for t, h in
                   ((q, self.n_heads), (k, self.n_kv_heads), (v, self.n_kv_heads)))
        if self.rotary:
            positions = self.positions(hidden_states, position_ids)
            q, k = self.rotate_half(q, positions), self.rotate_half(k, positions)
        groups = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        allow = allowed(attention_mask, q.shape[2], k.shape[2], q.device)
        return self.merge(F.scaled_dot_product_attention(q, k, v, attn_mask=allow))


FUSED_QKV = {"qkv.weight": ["q.weight", "k.weight", "v.weight"]}


def fuse_qkv(state: dict) -> dict:
    """:data:`FUSED_QKV` as a function, for the command line (``--weight-map``)."""
    out = {name: t for name, t in state.items() if name[0] not in "qkv"}
    out["qkv.weight"] = torch.cat([state[f"{p}.weight"] for p in "qkv"])
    return out


class InterleavedRotaryAttention(ThreeProjectionAttention):
    """Another rotary layout: GPT-J's adjacent pairs, on projections whose rows are permuted
    to match (:func:`interleave_rotary_rows`)."""

    def rotate_half(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(position_ids, x.dtype)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)


#: The head dim of the rotary twins: a weight map sees only the state, which does not hold it.
ROTARY_HEAD_DIM = 8


def interleave_rotary_rows(state: dict) -> dict:
    """Rotate-half weights to the interleaved layout: within each head of q and k (of
    :data:`ROTARY_HEAD_DIM`), row i of the first half goes to 2i and row i of the second half
    to 2i + 1."""
    out = dict(state)
    for name in ("q.weight", "k.weight"):
        w = state[name]
        heads = w.view(-1, 2, ROTARY_HEAD_DIM // 2, w.shape[-1])
        out[name] = heads.transpose(1, 2).reshape(w.shape)
    return out


def padded_batch(arguments: dict) -> dict:
    """Inputs of one check from the command line (``--inputs user_twins.py:padded_batch``):
    two rows of five tokens, the second left-padded to two."""
    hidden = torch.linspace(-2, 2, 2 * 5 * arguments["d_model"]).reshape(2, 5, -1)
    return {"hidden_states": hidden, "attention_mask": torch.tensor([[1] * 5, [0, 0, 0, 1, 1]])}


# --- planted bugs -------------------------------------------------------------------------


class TiledKVAttention(ThreeProjectionAttention):
    """GQA with the key/value heads tiled (head h reads kv head h % n_kv) instead of
    repeated in groups (h // group): the same for MHA and MQA, wrong in between."""

    def repeat_kv(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, self.n_heads // self.n_kv_heads, 1, 1)


class PaddedRowsFlippedAttention(ThreeProjectionAttention):
    """Builds an additive mask; in rows that hold padding the key-padding convention is
    read the other way round (0 taken for a real token)."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        if attention_mask is None:
            return super().forward(hidden_states)
        q = self.split(self.q(hidden_states), self.n_heads)
        k, v = (self.repeat_kv(self.split(p(hidden_states), self.n_kv_heads))
                for p in (self.k, self.v))
        real = attention_mask.bool()
        padded_rows = ~real.all(-1, keepdim=True)
        real = torch.where(padded_rows, ~real, real)
        allow = allowed(real, q.shape[2], k.shape[2], q.device)
        return self.merge(softmax_attention(q, k, v, allow, 1 / math.sqrt(self.head_dim)))


class EarlyCastRotaryAttention(ThreeProjectionAttention):
    """The rotary frequency scale applied after a cast to the compute dtype instead of before
    it: in bf16 a position past 256 is rounded (257 becomes 256) before it is scaled into an
    angle."""

    def cos_sin(self, position_ids: torch.Tensor, dtype: torch.dtype):
        angles = (position_ids.to(dtype).float()[..., None] * self.inv_freq())[:, None]
        return angles.cos().to(dtype), angles.sin().to(dtype)


# --- decoding: a KV cache ------------------------------------------------------------------


class ConcatCache:
    """The original cache: keys and values concatenated at every step."""

    def __init__(self) -> None:
        self.k = self.v = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat((self.k, k), dim=2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=2)
        return self.k, self.v


class PreallocatedCache:
    """The refactor: buffers grown in blocks of 4 positions, written in place."""

    block = 4

    def __init__(self) -> None:
        self.k = self.v = None
        self.length = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, stop = self.slots(k.shape[2])
        if self.k is None or stop > self.k.shape[2]:
            size = -(-stop // self.block) * self.block
            self.k, self.v = (self._grown(old, new, size) for old, new in
                              ((self.k, k), (self.v, v)))
        self.k[:, :, start:stop], self.v[:, :, start:stop] = k, v
        self.length = stop
        return self.k[:, :, :stop], self.v[:, :, :stop]

    def slots(self, n: int) -> tuple[int, int]:
        return self.length, self.length + n

    @staticmethod
    def _grown(old, new, size):
        grown = new.new_zeros(*new.shape[:2], size, new.shape[-1])
        if old is not None:
            grown[:, :, :old.shape[2]] = old
        return grown


class OffByOneCache(PreallocatedCache):
    """Writes every chunk after the first one slot too far: the slot it skips stays a zero
    key that every later query attends to."""

    def slots(self, n: int) -> tuple[int, int]:
        skip = 1 if self.length else 0
        return self.length + skip, self.length + skip + n


class CachedAttention(ThreeProjectionAttention):
    """Decoding attention: each call appends its chunk's keys and values to ``cache`` and
    attends to all of them, causal within the chunk."""

    def forward(self, hidden_states, cache):
        q = self.split(self.q(hidden_states), self.n_heads)
        k, v = cache.update(self.split(self.k(hidden_states), self.n_kv_heads),
                            self.split(self.v(hidden_states), self.n_kv_heads))
        k, v = self.repeat_kv(k), self.repeat_kv(v)
        allow = allowed(None, q.shape[2], k.shape[2], q.device)
        return self.merge(softmax_attention(q, k, v, allow, 1 / math.sqrt(self.head_dim)))
