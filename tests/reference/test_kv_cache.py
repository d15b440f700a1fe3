"""Incremental decoding with a KV cache gives, step by step, the logits of a full forward."""

from __future__ import annotations

import pytest
import torch

import torchparity as tp
from torchparity.reference import build_model, greedy_decode, variants, zoo
from torchparity.reference.cache import KVCache

STEPS = 4


def _inputs_key(config) -> tuple[str, str]:
    return ("tgt_ids", "tgt_mask") if config.is_encoder_decoder else ("input_ids",
                                                                      "attention_mask")


def _full_forward_logits(model, batch, tokens: torch.Tensor) -> torch.Tensor:
    """Logits each step's choice is made from, recomputing the whole sequence at every step."""
    ids_key, mask_key = _inputs_key(model.config)
    mask = batch.get(mask_key, torch.ones_like(batch[ids_key]))
    steps = []
    with torch.no_grad():
        for t in range(tokens.shape[1]):
            grown = dict(batch)
            grown[ids_key] = torch.cat((batch[ids_key], tokens[:, :t]), dim=1)
            grown[mask_key] = torch.cat((mask, torch.ones_like(tokens[:, :t])), dim=1)
            steps.append(model(**grown)[:, -1])
    return torch.stack(steps, dim=1)


@pytest.mark.parametrize("padding", ["left", "right", "none"])
@pytest.mark.parametrize("case_name", zoo.names())
def test_cached_decoding_equals_full_recompute(case_name: str, padding: str) -> None:
    config = zoo.get(case_name).config
    batch = zoo.make_batch(config, batch_size=3, seq_len=8, seed=4, padding=padding)
    model32 = build_model(config, seed=1)
    cached = greedy_decode(model32, batch, STEPS)
    # Feed both recomputations the cached run's tokens so a single flipped argmax cannot
    # derail the comparison; golden float64, baseline fp32, both without a cache.
    golden = _full_forward_logits(build_model(config, seed=1, dtype=torch.float64), batch,
                                  cached.tokens)
    baseline = _full_forward_logits(model32, batch, cached.tokens)
    tp.assert_parity(cached.logits, golden, baseline=baseline, kind="forward")


def _new_cache(model, cache: str) -> KVCache:
    # A chunk of 2 makes the preallocated buffers grow during the step after the reorder.
    return model.new_cache() if cache == "concatenating" else variants.PreallocatedKVCache(2)


# Beam search's reorders: a permutation that moves every row (a store left out of the reorder
# answers with another row's keys), and one that keeps a row twice and drops another.
BEAMS = {"permuted": [2, 0, 1], "regrouped": [2, 2, 0]}


@pytest.mark.parametrize("beams", list(BEAMS))
@pytest.mark.parametrize("padding", ["left", "right", "none"])
@pytest.mark.parametrize("cache", ["concatenating", "preallocated"])
@pytest.mark.parametrize("case_name", ["llama-tiny", "mqa", "encdec-prenorm", "alibi"])
def test_reordered_beams_continue_like_a_full_forward(case_name: str, cache: str,
                                                      padding: str, beams: str) -> None:
    config = zoo.get(case_name).config
    batch = zoo.make_batch(config, batch_size=3, seq_len=6, seed=5, padding=padding)
    ids_key, mask_key = _inputs_key(config)
    batch.setdefault(mask_key, torch.ones_like(batch[ids_key]))
    index = torch.tensor(BEAMS[beams])
    next_tokens = torch.tensor([[3], [7], [11]])
    results = {}
    for dtype in (torch.float64, torch.float32):
        model = build_model(config, seed=2, dtype=dtype)
        kv = _new_cache(model, cache)
        with torch.no_grad():
            model(**batch, cache=kv)
            kv.reorder(index)
            step = {key: value[index] for key, value in batch.items()}
            full = dict(step)
            full[ids_key] = torch.cat((step[ids_key], next_tokens), dim=1)
            full[mask_key] = torch.cat((step[mask_key], torch.ones_like(next_tokens)), dim=1)
            step[ids_key], step[mask_key] = next_tokens, full[mask_key]
            results[dtype] = (model(**step, cache=kv)[:, -1], model(**full)[:, -1])
    cached, baseline = results[torch.float32]
    _, golden = results[torch.float64]
    tp.assert_parity(cached, golden, baseline=baseline, kind="forward")


def test_cache_rejects_a_mask_that_does_not_cover_cached_tokens() -> None:
    case = zoo.get("llama-tiny")
    model = build_model(case.config)
    batch = zoo.case_batch(case)
    cache = model.new_cache()
    model(**batch, cache=cache)
    with pytest.raises(ValueError, match=r"expected \(2, 13\)"):
        model(batch["input_ids"][:, :1], batch["attention_mask"][:, :1], cache=cache)
