"""Multi-head attention (MHA, GQA, MQA) for self- and cross-attention."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from torchparity import backends
from torchparity.reference.cache import KVCache
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

    def __init__(self, config, layer_idx: int, *, cross: bool = False) -> None:
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
        return x.unflatten(-1, (n_heads, self.head_dim)).transpose(1, 2)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        return self.split_heads(self.q_proj(x), self.n_heads)

    def project_kv(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.split_heads(self.k_proj(source), self.n_kv_heads),
                self.split_heads(self.v_proj(source), self.n_kv_heads))

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.project_q(x), *self.project_kv(x))

    def forward(self, x: torch.Tensor, ctx: AttentionContext,
                memory: torch.Tensor | None = None) -> torch.Tensor:
        # Written as steps (project, rotate, position bias, attend, merge) so that refactored
        # twins in reference/variants.py can replace exactly one of them.
        q, k, v = self.project(x, ctx, memory)
        out = self.attend(q, k, v, ctx, self.position_bias(q, ctx))
        return self.o_proj(self.merge_heads(out))

    def project(self, x: torch.Tensor, ctx: AttentionContext, memory: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, and keys/values with positions applied and the cache's entries prepended."""
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
        return apply_rotary(x, positions, rotary_dim=self.config.rotary_dims,
                            theta=self.config.rope_theta, layout=self.config.rotary_layout)

    def position_bias(self, q: torch.Tensor, ctx: AttentionContext) -> torch.Tensor | None:
        if self.positions == "alibi":
            return alibi_bias(ctx.q_positions, ctx.k_positions, self.n_heads, q.dtype)
        if self.relative is not None:
            return self.relative(q, ctx.q_positions, ctx.k_positions, self.scale)
        return None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext,
               bias: torch.Tensor | None) -> torch.Tensor:
        return backends.attention(
            q, k, v, mask=ctx.mask, bias=bias, scale=self.scale, causal=ctx.causal,
            backend=backends.current(self.config.attention_backend),
        )

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).flatten(-2)
