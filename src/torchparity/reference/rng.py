"""Counter-based random numbers that are the same on every machine and torch version.

SplitMix64 in numpy integer arithmetic, no library random stream whose algorithm may change:
goldens store only checksums of the zoo's weights. Each ``stream`` name is an independent
sequence, so adding a parameter never shifts others.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import torch

_GAMMA = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _bits(seed: int, stream: str, n: int) -> np.ndarray:
    key = (int(seed) & 0xFFFFFFFF) << 32 | zlib.crc32(stream.encode())
    base = _splitmix64(np.array([key], dtype=np.uint64))[0]
    with np.errstate(over="ignore"):
        counters = base + np.arange(1, n + 1, dtype=np.uint64) * _GAMMA
    return _splitmix64(counters)


def uniform(seed: int, stream: str, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """A float64 CPU tensor of ``shape``, uniform in [0, 1), a pure function of the arguments."""
    n = math.prod(shape)
    values = (_bits(seed, stream, n) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return torch.from_numpy(values).reshape(tuple(shape))


def symmetric(seed: int, stream: str, shape: tuple[int, ...] | torch.Size, std: float
              ) -> torch.Tensor:
    """A float64 CPU tensor uniform in [-a, a], standard deviation ``std`` (a = sqrt(3) std)."""
    return (uniform(seed, stream, shape) * 2.0 - 1.0) * (math.sqrt(3.0) * std)


def integers(seed: int, stream: str, shape: tuple[int, ...] | torch.Size, low: int, high: int
             ) -> torch.Tensor:
    """An int64 CPU tensor of integers uniform in [low, high)."""
    return (uniform(seed, stream, shape) * (high - low)).floor().to(torch.int64) + low
