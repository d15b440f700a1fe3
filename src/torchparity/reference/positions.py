"""Position encodings: absolute (sinusoidal, learned), rotary, ALiBi and Shaw relative.

Every function takes explicit (batch, seq) ``positions``, not ``arange``: a left-padded token's
position is its index among the real tokens, so padded and unpadded runs agree.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype trigonometry runs in: fp32 (angles lose precision below it), fp64 for fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def sinusoidal(positions: torch.Tensor, dim: int, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """Vaswani et al.'s (batch, seq, dim) sinusoidal encodings, computed in compute_dtype."""
    # layout "interleaved": sin/cos in alternating channels (the paper); "concatenated": sines first
    # (tensor2tensor)
    cdtype = compute_dtype(dtype)
    inv_freq = torch.exp(
        torch.arange(0, dim, 2, dtype=cdtype, device=positions.device) * (-math.log(10000.0) / dim)
    )
    angles = positions.to(cdtype)[..., None] * inv_freq
    if layout == "interleaved":
        table = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
    else:
        table = torch.cat((angles.sin(), angles.cos()), dim=-1)
    return table.to(dtype)


def rotary_angles(positions: torch.Tensor, rotary_dim: int, theta: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """(batch, seq, rotary_dim // 2) angles ``position * theta^(-2i/rotary_dim)``, compute dtype."""
    cdtype = compute_dtype(dtype)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device)
    inv_freq = 1.0 / (theta ** (exponents.to(cdtype) / rotary_dim))
    return positions.to(cdtype)[..., None] * inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dimension (Llama's layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """``(a, b) -> (-b, a)`` on each adjacent channel pair (GPT-J's layout)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, *, rotary_dim: int, theta: float,
                 layout: str) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` channels of ``x`` (batch, heads, seq, head_dim)."""
    # layout "half" pairs channel i with i + rotary_dim/2 (Llama, GPT-NeoX), "interleaved" 2i with
    # 2i+1 (GPT-J); the rest pass
    angles = rotary_angles(positions, rotary_dim, theta, x.dtype)[:, None]  # (b, 1, s, r/2)
    if layout == "half":
        angles, rotate = torch.cat((angles, angles), dim=-1), rotate_half
    else:
        angles, rotate = angles.repeat_interleave(2, dim=-1), rotate_pairs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + rotate(x_rot) * sin, x_pass), dim=-1)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Per-head ALiBi slopes (Press et al.), float64, the paper's rule for non-power-of-2 heads."""

    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = powers(closest) + powers(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float64)


def alibi_bias(q_positions: torch.Tensor, k_positions: torch.Tensor, n_heads: int,
               dtype: torch.dtype) -> torch.Tensor:
    """ALiBi's additive bias ``-slope * |q_pos - k_pos|``, (batch, heads, q, k), compute dtype."""
    cdtype = compute_dtype(dtype)
    distance = (q_positions[:, :, None] - k_positions[:, None, :]).abs().to(cdtype)
    slopes = alibi_slopes(n_heads).to(device=distance.device, dtype=cdtype)
    return -slopes[None, :, None, None] * distance[:, None]


class LearnedPositions(nn.Module):
    """A trained table of absolute position embeddings (GPT-2, BERT)."""

    def __init__(self, max_positions: int, dim: int) -> None:
        super().__init__()
        self.max_positions = max_positions
        self.weight = nn.Parameter(torch.empty(max_positions, dim))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        # Checked in eager mode only: reading a tensor's value would break a compiled graph.
        """The (batch, seq, dim) embeddings of ``positions``; a ``ValueError`` past the table."""
        if not torch.compiler.is_compiling() and int(positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(positions.max())} exceeds max_positions="
                             f"{self.max_positions}; raise TransformerConfig.max_positions")
        return self.weight[positions]


class RelativePositions(nn.Module):
    """Shaw et al. (2018) relative position keys: score_ij += scale * q_i . a_clip(j - i)."""

    # only the paper's key term, as an additive bias: it works on every backend taking one
    def __init__(self, max_relative_positions: int, head_dim: int) -> None:
        super().__init__()
        self.max_relative_positions = max_relative_positions
        self.weight = nn.Parameter(torch.empty(2 * max_relative_positions + 1, head_dim))

    def forward(self, q: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor,
                scale: float) -> torch.Tensor:
        """The (batch, heads, q, k) relative-position score bias ``scale * q_i . a_clip(j - i)``."""
        m = self.max_relative_positions
        distance = (k_positions[:, None, :] - q_positions[:, :, None]).clamp(-m, m) + m
        keys = self.weight[distance]  # (batch, q, k, head_dim)
        return torch.einsum("bhqd,bqkd->bhqk", q, keys) * scale
