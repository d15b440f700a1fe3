"""Decoding step by step through a ``transformers`` causal LM's cache reproduces its own
greedy ``generate`` (its logits to float32 rounding, which is all generate keeps), with or
without a left-padded prompt; after a right-padded one each step equals the model run on the
whole sequence, and teacher forcing feeds the given tokens whatever the model prefers."""

from __future__ import annotations

import pytest
import torch

from torchparity.subject import hf
from torchparity.subject.steps import decode_steps, hf_step, steppable

tiny_transformers = pytest.importorskip("tiny_transformers")

STEPS = 4


def _model_and_prompt(family: str, padded: bool):
    torch.manual_seed(0)
    model = tiny_transformers.FAMILIES[family][0]().double().eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(3, tiny_transformers.VOCAB, (2, 6),
                        generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :2] = 0  # the second prompt is padded on the left
    return model, ids, mask


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_steps_reproduce_greedy_generate(family: str, padded: bool) -> None:
    model, ids, mask = _model_and_prompt(family, padded)
    expected = hf.greedy_generate(model, {"input_ids": ids, "attention_mask": mask}, STEPS,
                                  use_cache=True)
    tokens = expected["tokens"][:, ids.shape[1]:]
    stepped = decode_steps(model, hf_step(mask), ids, STEPS, tokens)
    # generate hands out its raw logits in float32 (and keeps the end-of-sequence token out
    # of the choice until min_new_tokens): its tokens are fed, its logits matched in float32.
    torch.testing.assert_close(stepped["logits"].float(), expected["logits"], rtol=2e-7,
                               atol=1e-7)
    greedy = decode_steps(model, hf_step(mask), ids, STEPS)
    assert torch.equal(greedy["tokens"][:, 0], expected["logits"][:, 0].argmax(-1))


def test_teacher_forcing_feeds_the_given_tokens() -> None:
    model, ids, mask = _model_and_prompt("llama", padded=False)
    greedy = decode_steps(model, hf_step(mask), ids, STEPS)
    forced_tokens = (greedy["tokens"] + 1) % tiny_transformers.VOCAB
    forced = decode_steps(model, hf_step(mask), ids, STEPS, forced_tokens)
    assert torch.equal(forced["tokens"], forced_tokens)
    torch.testing.assert_close(forced["logits"][:, 0], greedy["logits"][:, 0], rtol=0, atol=0)
    # From the second step on, the model sees another sequence than its greedy one.
    full = torch.cat((ids, forced_tokens[:, :1]), dim=1)
    with torch.no_grad():
        recomputed = model(input_ids=full).logits[:, -1]
    torch.testing.assert_close(forced["logits"][:, 1], recomputed, rtol=0, atol=1e-12)


def test_after_a_right_padded_prompt_each_step_is_the_whole_sequence_recomputed() -> None:
    model, ids, mask = _model_and_prompt("llama", padded=False)
    mask[1, 4:] = 0
    stepped = decode_steps(model, hf_step(mask), ids, STEPS)
    real = ids[1, :4]  # the second row without its padding, and its new tokens
    # (Step 0 reads the prompt's last position, which is padding in this row.)
    for step in range(1, STEPS):
        sequence = torch.cat((real, stepped["tokens"][1, :step]))[None]
        with torch.no_grad():
            expected = model(input_ids=sequence).logits[0, -1]
        torch.testing.assert_close(stepped["logits"][1, step], expected, rtol=0, atol=1e-12)


def test_only_decoder_only_generating_models_step() -> None:
    assert steppable(tiny_transformers.gpt2())
    assert not steppable(tiny_transformers.bert())  # does not generate
    assert not steppable(tiny_transformers.bart())  # encoder-decoder
