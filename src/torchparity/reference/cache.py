"""Key/value cache for incremental decoding."""

from __future__ import annotations

from collections.abc import Callable

import torch


class KVCache:
    """Keys and values of every attention layer seen so far, grown by concatenation.

    Cross-attention entries and the encoder's output (``memory``) are computed once, on the first
    call; ``reorder`` selects batch rows (beam search) in all of them at once.
    """

    def __init__(self) -> None:
        self.self_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cross_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.memory: torch.Tensor | None = None

    def __len__(self) -> int:
        """Number of positions cached (0 before the first call)."""
        first = self.self_kv.get(0)
        return 0 if first is None else first[0].shape[-2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add this call's keys and values to ``layer``'s; those of every position so far."""
        if layer in self.self_kv:
            past_k, past_v = self.self_kv[layer]
            k, v = torch.cat((past_k, k), dim=-2), torch.cat((past_v, v), dim=-2)
        self.self_kv[layer] = (k, v)
        return k, v

    def cross(self, layer: int, compute: Callable[[], tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention keys and values of ``layer``, computed the first time only."""
        if layer not in self.cross_kv:
            self.cross_kv[layer] = compute()
        return self.cross_kv[layer]

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (in that order) everywhere, e.g. surviving beams."""
        for store in (self.self_kv, self.cross_kv):
            for layer, (k, v) in store.items():
                store[layer] = (k.index_select(0, index), v.index_select(0, index))
        if self.memory is not None:
            self.memory = self.memory.index_select(0, index)
