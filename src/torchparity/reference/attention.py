"""Multi-head attention (MHA, GQA, MQA) for self- and cross-attention."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from torchparity import backends
from torchparity.reference.cache import KVCache
from torchparity.reference.config import TransformerConfig
from torchparity.reference.positions import RelativePositions, alibi_bias, apply_rotary


@dataclass
class AttentionContext:
    """What a stack computes once per forward and every layer's attention shares."""

    q_positions: torch.Tensor  # (batch, q_len) positions of the queries
    k_positions: torch.Tensor  # (batch, k_len) positions of all keys, cached ones included
    mask: torch.Tensor | None  # bool (batch, 1, q_len, k_len), True = may attend
    causal: bool  # the mask is exactly "causal, no padding": kernels may apply it themselves
    cache: KVCache | None = None


class Attention(nn.Module):
    """Projections, position handling and the call into :func:`torchparity.backends.attention`."""

    def __init__(self, config: TransformerConfig, layer_idx: int, *, cross: bool = False
                 ) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.cross = cross
        self.n_heads, self.n_kv_heads = config.n_heads, config.kv_heads
        self.head_dim = config.dim_head
        self.scale = 1.0 / math.sqrt(self.head_dim)
        d, qkv_bias = config.d_model, config.qkv_bias
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=config.out_bias)
        self.positions = config.positions if not cross else "none"
        self.relative = (RelativePositions(config.max_relative_positions, self.head_dim)
                         if self.positions == "relative" else None)

    def split_heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        """(batch, len, heads * head_dim) -> (batch, heads, len, head_dim)."""
        return x.unflatten(-1, (n_heads, self.head_dim)).transpose(1, 2)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        """The queries of ``x``, (batch, heads, len, head_dim), before any rotation."""
        return self.split_heads(self.q_proj(x), self.n_heads)

    def project_kv(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of ``source``, each (batch, kv_heads, len, head_dim), unrotated."""
        # source: the layer's input, or the encoder's output
        return (self.split_heads(self.k_proj(source), self.n_kv_heads),
                self.split_heads(self.v_proj(source), self.n_kv_heads))

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of ``x``: one step a fused twin replaces."""
        return (self.project_q(x), *self.project_kv(x))

    def forward(self, x: torch.Tensor, ctx: AttentionContext,
                memory: torch.Tensor | None = None) -> torch.Tensor:
        # Written as steps (project, rotate, position bias, attend, merge) so that refactored
        # twins in reference/variants.py can replace exactly one of them.
        """Attend from ``x`` (batch, len, d_model) to itself, or to ``memory`` (cross-attention)."""
        q, k, v = self.project(x, ctx, memory)
        out = self.attend(q, k, v, ctx, self.position_bias(q, ctx))
        return self.o_proj(self.merge_heads(out))

    def project(self, x: torch.Tensor, ctx: AttentionContext, memory: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v)`` in heads, rotated, ``k`` and ``v`` covering every cached position."""
        # the encoder's memory is projected once, then cached
        if self.cross:
            compute = lambda: self.project_kv(memory)  # noqa: E731
            k, v = compute() if ctx.cache is None else ctx.cache.cross(self.layer_idx, compute)
            return self.project_q(x), k, v
        q, k, v = self.project_qkv(x)
        if self.positions == "rotary":
            q = self.rotate(q, ctx.q_positions)
            k = self.rotate(k, ctx.k_positions[:, -k.shape[-2]:])
        if ctx.cache is not None:
            k, v = ctx.cache.append(self.layer_idx, k, v)
        return q, k, v

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x`` (batch, heads, len, head_dim) rotated by its positions in the config's layout."""
        return apply_rotary(x, positions, rotary_dim=self.config.rotary_dims,
                            theta=self.config.rope_theta, layout=self.config.rotary_layout)

    def position_bias(self, q: torch.Tensor, ctx: AttentionContext) -> torch.Tensor | None:
        """The additive score bias of ALiBi or relative positions, or None."""
        if self.positions == "alibi":  # broadcastable to (batch, heads, q_len, k_len)
            return alibi_bias(ctx.q_positions, ctx.k_positions, self.n_heads, q.dtype)
        if self.relative is not None:
            return self.relative(q, ctx.q_positions, ctx.k_positions, self.scale)
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
               bias: torch.Tensor | None) -> torch.Tensor:
        """Scaled dot-product attention (batch, heads, q_len, head_dim) on the config's backend."""
        return backends.attention(
            q, k, v, mask=ctx.mask, bias=bias, scale=self.scale, causal=ctx.causal,
            backend=backends.current(self.config.attention_backend),
        )

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads, len, head_dim) -> (batch, len, heads * head_dim)."""
        return x.transpose(1, 2).flatten(-2)
