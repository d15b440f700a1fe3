"""Beam search on the step protocol: the built-in steps and reorders search as ``transformers``'
``generate`` does (the same n-best), finished hypotheses leave the beam at the end-of-sequence
token, and the prompt expands to its beams as ``generate`` expands it."""

from __future__ import annotations

import pytest
import torch

from torchparity.subject.beams import (
    BeamSearch,
    BeamSettings,
    builtin_reorder,
    expand_prompt,
    pool,
    rescored,
)
from torchparity.subject.decoding import builtin_step, teacher_forced

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

BEAMS, STEPS = 4, 5


def _searched(model, inputs, settings: BeamSettings):
    """The search over ``inputs``, the tokens and parents it fed, and its n-best per prompt."""
    prompts = next(iter(inputs.values())).shape[0]
    search = BeamSearch(settings, prompts)
    with torch.no_grad():
        decoded = teacher_forced(builtin_step(model), model, expand_prompt(inputs, settings.beams),
                                 STEPS, reorder=builtin_reorder(model), decide=search.decide)
    pools = pool(search.history, decoded.tokens, decoded.parents, decoded.logits[0].shape[-1])
    nbest = []
    for hypotheses in pools:
        order = rescored(search.history, hypotheses, settings.length_penalty).argsort(
            descending=True)
        nbest.append([hypotheses[i].tokens for i in order[:settings.beams]])
    return decoded, nbest


@pytest.mark.transformers
@pytest.mark.parametrize("family", ["llama", "bart"])
def test_the_built_in_search_keeps_the_n_best_generate_keeps(family: str) -> None:
    import tiny_transformers

    model = tiny_transformers.generator(family)
    model.generation_config.eos_token_id = None  # every hypothesis runs every step
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    _, nbest = _searched(model, inputs, BeamSettings(BEAMS))
    with torch.no_grad():
        generated = model.generate(**inputs, do_sample=False, num_beams=BEAMS,
                                   num_return_sequences=BEAMS, max_new_tokens=STEPS,
                                   length_penalty=1.0, pad_token_id=0)
    expected = generated[:, -STEPS:].reshape(2, BEAMS, STEPS).tolist()
    assert [[list(h) for h in prompt] for prompt in nbest] == expected


def test_a_hypothesis_ends_at_the_end_of_sequence_token_and_leaves_the_beam() -> None:
    from torchparity.reference import build_model, zoo

    model = build_model(zoo.get("llama-tiny").config, seed=0)
    batch = zoo.make_batch(model.config, batch_size=2, seq_len=6, seed=0)
    free, _ = _searched(model, batch, BeamSettings(BEAMS))
    eos = int(free.tokens[0, 1])  # a token the search takes early on
    decoded, nbest = _searched(model, batch, BeamSettings(BEAMS, eos=eos))
    assert not (decoded.tokens == eos).any()  # no live row carries it
    hypotheses = [h for prompt in nbest for h in prompt]
    ended = [h for h in hypotheses if len(h) < STEPS]
    assert ended and all(h[-1] == eos and eos not in h[:-1] for h in ended)
    assert all(eos not in h for h in hypotheses if len(h) == STEPS)


def test_the_prompt_expands_row_by_row_as_generate_expands_it() -> None:
    ids = torch.arange(6).reshape(2, 3)
    expanded = expand_prompt({"input_ids": ids, "scale": torch.tensor(2.0)}, 3)
    assert expanded["input_ids"].tolist() == [[0, 1, 2]] * 3 + [[3, 4, 5]] * 3
    assert expanded["scale"].item() == 2.0
