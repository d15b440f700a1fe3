"""Greedy decoding, incremental (KV cache) or by full recompute, for both model kinds."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from torchparity.reference.models import Model


@dataclass
class Decoded:
    """A greedy decoding: the tokens chosen, their log-probabilities and the logits behind them."""
    tokens: torch.Tensor  # (batch, steps) int64
    logprobs: torch.Tensor  # (batch, steps) log-probability of each chosen token
    logits: torch.Tensor  # (batch, steps, vocab) logits each step's choice was made from


def _prompt(model: Model, batch: Mapping[str, torch.Tensor]) -> tuple[str, str]:
    return ("tgt_ids", "tgt_mask") if model.config.is_encoder_decoder else ("input_ids",
                                                                            "attention_mask")


@torch.no_grad()
def greedy_decode(model: Model, batch: Mapping[str, torch.Tensor], steps: int, *,
                  use_cache: bool = True) -> Decoded:
    """Extend the prompt in ``batch`` by ``steps`` greedy tokens, with a ``KVCache`` or recomputing.

    Both ways give the same tokens up to floating-point reordering, which is what a
    cached-against-recomputed check compares.

    Args:
        model: a reference model.
        batch: its keyword arguments; the prompt is ``input_ids`` (decoder) or ``tgt_ids``
            (encoder-decoder, usually a start token), padded on either side.
        steps: the tokens added.
        use_cache: feed one token a step through a
            :class:`~torchparity.reference.cache.KVCache`, else recompute the whole sequence.
    """
    ids_key, mask_key = _prompt(model, batch)
    ids = batch[ids_key]
    mask = batch.get(mask_key)
    mask = torch.ones_like(ids) if mask is None else mask
    cache = model.new_cache() if use_cache else None
    inputs = dict(batch)
    step_ids = ids
    tokens, logprobs, step_logits = [], [], []
    for _ in range(steps):
        inputs[ids_key], inputs[mask_key] = (step_ids if use_cache else ids), mask
        logits = model(**inputs, cache=cache)[:, -1]
        token = logits.argmax(-1)
        logp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
        tokens.append(token)
        logprobs.append(logp.gather(-1, token[:, None])[:, 0])
        step_logits.append(logits)
        step_ids = token[:, None]
        ids = torch.cat((ids, step_ids), dim=1)
        mask = torch.cat((mask, torch.ones_like(step_ids)), dim=1)
    return Decoded(torch.stack(tokens, 1), torch.stack(logprobs, 1), torch.stack(step_logits, 1))
