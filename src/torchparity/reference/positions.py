"""Position encodings: absolute (sinusoidal, learned), rotary, ALiBi and Shaw relative.

Every function takes explicit integer ``positions`` (batch, seq) rather than assuming
``arange``: with left padding a token's position is its index among the real tokens, which is
what makes padded and unpadded runs agree.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype trigonometry runs in: fp32, or fp64 when the model itself is fp64.

    Angles computed below fp32 lose visible precision at large positions and bases.

    Args:
        dtype: the model's dtype.

    Returns:
        float64 or float32.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def sinusoidal(positions: torch.Tensor, dim: int, layout: str, dtype: torch.dtype) -> torch.Tensor:
    """Vaswani et al.'s sinusoidal position encodings.

    Args:
        positions: (batch, seq) integer positions.
        dim: the model's width (even).
        layout: "interleaved" puts sin/cos in alternating channels (the paper),
            "concatenated" all sines first (tensor2tensor).
        dtype: the encodings' dtype (computed in :func:`compute_dtype`).

    Returns:
        (batch, seq, dim).
    """
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
    """Rotation angles ``position * theta^(-2i/rotary_dim)`` of every position and channel pair.

    Args:
        positions: (batch, seq) integer positions.
        rotary_dim: the rotated channels (even).
        theta: the rotary base.
        dtype: the model's dtype, which picks the compute dtype.

    Returns:
        (batch, seq, rotary_dim // 2) in the compute dtype.
    """
    cdtype = compute_dtype(dtype)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device)
    inv_freq = 1.0 / (theta ** (exponents.to(cdtype) / rotary_dim))
    return positions.to(cdtype)[..., None] * inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``(x1, x2) -> (-x2, x1)`` on the two halves of the last dimension (Llama's layout).

    Args:
        x: (..., 2n).

    Returns:
        (..., 2n).
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """``(a, b) -> (-b, a)`` on each adjacent channel pair (GPT-J's layout).

    Args:
        x: (..., 2n).

    Returns:
        (..., 2n).
    """
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, *, rotary_dim: int, theta: float,
                 layout: str) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` channels of ``x`` by its positions.

    Channels past ``rotary_dim`` pass through unchanged (partial rotary).

    Args:
        x: queries or keys, (batch, heads, seq, head_dim).
        positions: (batch, seq) integer positions.
        rotary_dim: the rotated channels.
        theta: the rotary base.
        layout: "half" rotates channel i with i + rotary_dim/2 (Llama, GPT-NeoX);
            "interleaved" rotates channels 2i and 2i+1 (GPT-J, the original RoFormer).

    Returns:
        The rotated tensor, in ``x``'s dtype.
    """
    angles = rotary_angles(positions, rotary_dim, theta, x.dtype)[:, None]  # (b, 1, s, r/2)
    if layout == "half":
        angles, rotate = torch.cat((angles, angles), dim=-1), rotate_half
    else:
        angles, rotate = angles.repeat_interleave(2, dim=-1), rotate_pairs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + rotate(x_rot) * sin, x_pass), dim=-1)


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """Per-head ALiBi slopes (Press et al.), with the paper's rule for non-power-of-2 heads.

    Args:
        n_heads: the heads.

    Returns:
        (n_heads,) float64.
    """

    def powers(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_heads))
    slopes = powers(closest) + powers(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float64)


def alibi_bias(q_positions: torch.Tensor, k_positions: torch.Tensor, n_heads: int,
               dtype: torch.dtype) -> torch.Tensor:
    """ALiBi's additive bias ``-slope * |q_pos - k_pos|``.

    Args:
        q_positions: (batch, q) integer positions.
        k_positions: (batch, k) integer positions.
        n_heads: the heads, one slope each.
        dtype: the model's dtype, which picks the compute dtype.

    Returns:
        (batch, heads, q, k) in the compute dtype.
    """
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
        """The embeddings of ``positions``.

        Args:
            positions: (batch, seq) integer positions.

        Returns:
            (batch, seq, dim).

        Raises:
            ValueError: a position past the table (checked in eager mode only).
        """
        if not torch.compiler.is_compiling() and int(positions.max()) >= self.max_positions:
            raise ValueError(f"position {int(positions.max())} exceeds max_positions="
                             f"{self.max_positions}; raise TransformerConfig.max_positions")
        return self.weight[positions]


class RelativePositions(nn.Module):
    """Shaw et al. (2018) relative position keys: score_ij += scale * q_i . a_clip(j - i).

    Only the key term of the paper is used (as in most implementations that followed); it enters
    attention as an additive bias, so it works on every backend that takes one.
    """

    def __init__(self, max_relative_positions: int, head_dim: int) -> None:
        super().__init__()
        self.max_relative_positions = max_relative_positions
        self.weight = nn.Parameter(torch.empty(2 * max_relative_positions + 1, head_dim))

    def forward(self, q: torch.Tensor, q_positions: torch.Tensor, k_positions: torch.Tensor,
                scale: float) -> torch.Tensor:
        """The relative-position score bias ``scale * q_i . a_clip(j - i)``.

        Args:
            q: (batch, heads, q, head_dim) queries.
            q_positions: (batch, q) integer positions.
            k_positions: (batch, k) integer positions.
            scale: the attention's score scale.

        Returns:
            (batch, heads, q, k), added to the scores.
        """
        m = self.max_relative_positions
        distance = (k_positions[:, None, :] - q_positions[:, :, None]).clamp(-m, m) + m
        keys = self.weight[distance]  # (batch, q, k, head_dim)
        return torch.einsum("bhqd,bqkd->bhqk", q, keys) * scale
