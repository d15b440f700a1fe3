"""The toy decoder of ``toy_decoders.py`` in a beam search, written the way NMT toolkits write
theirs: the generator's state holds the decoder, and reordering it calls the decoder's
``map_state(fn)``, which applies ``fn`` to every cached tensor (OpenNMT's ``map_state``,
fairseq's ``reorder_incremental_state``, transformers' ``_reorder_cache``). Factories, same
weights and prompt, with a ``step`` and a ``reorder`` for torchparity's beam search:

- ``clean``: every cache part reordered;
- ``forgetful``: the refactor's ``map_state`` reorders the keys and forgets the values, so after
  a reorder that moves a row, attention reads another hypothesis' values (a real change);
- ``reordered``: the clean ``map_state``, attention summing its values in reverse order
  (legitimate rounding noise); ``*_twins``: with the twin tokens of ``toy_decoders.py``, so
  that beam candidates between twins are near ties.

:class:`ValuesLeftBehind` is the same refactor of a reference model's ``KVCache``; ``stale_rows``
says which rows such a refactor leaves stale, from the search alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from toy_decoders import ReorderedSelfAttention, SelfAttention, ToyDecoder, make

from torchparity.reference import KVCache
from torchparity.subject.beams import lineage


class BeamDecoder(ToyDecoder):
    """The toy decoder with the toolkit's hook for beam search."""

    def map_state(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for layer in self.layers:
            layer.self_attn.k_cache = fn(layer.self_attn.k_cache)
            layer.self_attn.v_cache = fn(layer.self_attn.v_cache)


class ForgetfulBeamDecoder(BeamDecoder):
    """The refactor: the values' cache is left out of ``map_state``."""

    def map_state(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for layer in self.layers:
            layer.self_attn.k_cache = fn(layer.self_attn.k_cache)


class ValuesLeftBehind(KVCache):
    """The same refactor of a reference model's cache: its reorder forgets the values."""

    def reorder(self, index: torch.Tensor) -> None:
        values = {layer: v for layer, (_, v) in self.self_kv.items()}
        super().reorder(index)
        self.self_kv = {layer: (k, values[layer]) for layer, (k, _) in self.self_kv.items()}


def beam_step(model: BeamDecoder, tokens, state):
    """The generator as a torchparity step: its state is the decoder and the step counter."""
    if state is None:
        return model(tokens["ids"], step=0), {"decoder": model, "step": tokens["ids"].shape[1]}
    step = state["step"] + 1
    return model(tokens, step=step), {"decoder": model, "step": step}


def reorder(state, index: torch.Tensor):
    """The generator's reorder between beam steps: every cached row takes its parent's."""
    state["decoder"].map_state(lambda t: t.index_select(0, index))
    return state


def _make(decoder: type[BeamDecoder], attention=SelfAttention, twins: bool = False) -> dict:
    made = make(attention, twins=twins, decoder=decoder)
    made["inputs"] = {"ids": made["inputs"]["ids"][:2]}  # two prompts, a beam of each
    return {**made, "step": beam_step, "reorder": reorder}


def clean() -> dict:
    return _make(BeamDecoder)


def forgetful() -> dict:
    return _make(ForgetfulBeamDecoder)


def reordered() -> dict:
    return _make(BeamDecoder, ReorderedSelfAttention)


def clean_twins() -> dict:
    return _make(BeamDecoder, twins=True)


def reordered_twins() -> dict:
    return _make(BeamDecoder, ReorderedSelfAttention, twins=True)


# What a reorder that leaves a cache part behind makes stale: a property of the search alone.


def stale_rows(tokens: torch.Tensor, parents: torch.Tensor, step: int) -> list[int]:
    """The rows whose parent at ``step`` holds other tokens than they do (the prompt of a row
    is that of its parent: a search never leaves its prompt's rows)."""
    held = lineage(tokens[:, :step - 1], parents[:, :step - 1])
    index = parents[:, step - 1]
    return [r for r in range(len(index)) if not torch.equal(held[r], held[index[r]])]


def first_moving_reorder(tokens: torch.Tensor, parents: torch.Tensor) -> int:
    """The first step whose reorder moves a row to a parent holding other tokens."""
    return next(s for s in range(1, tokens.shape[1] + 1) if stale_rows(tokens, parents, s))
