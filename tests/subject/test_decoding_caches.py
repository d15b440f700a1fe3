"""The built-in step on every kind of cache ``transformers`` has: a state-space model's states
and a sliding-window hybrid's cache decode and search as ``generate`` does, and a model that
returns no cache (a BERT-style model that is no decoder) is decoded by full recomputation,
saying so once."""

from __future__ import annotations

import pytest
import torch

from tiny_transformers import needs_5
from torchparity.subject import decoding
from torchparity.subject.beams import (
    BeamSearch,
    BeamSettings,
    builtin_reorder,
    expand_prompt,
    pool,
    rescored,
)
from torchparity.subject.decoding import builtin_step, teacher_forced

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("single_thread")]

STEPS, BEAMS = 4, 3


def _tiny(family: str):
    """A float64 tiny model of ``family`` whose every hypothesis runs every step, and its two
    prompts (the second left-padded)."""
    import transformers

    from torchparity.subject import hf_families

    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    model = hf_families.tiny_model(family, dtype=torch.float64)
    model.generation_config.eos_token_id = None
    return model, hf_families.prompts(model.config)


@pytest.mark.parametrize("family", ["mamba", "cohere2"])
def test_state_space_and_sliding_window_caches_decode_as_generate_does(family: str) -> None:
    model, inputs = _tiny(family)
    with torch.no_grad():
        decoded = teacher_forced(builtin_step(model), model, inputs, STEPS)
        generated = model.generate(**inputs, do_sample=False, num_beams=1,
                                   max_new_tokens=STEPS + 1, output_logits=True,
                                   return_dict_in_generate=True, pad_token_id=0)
    assert torch.equal(decoded.tokens, generated.sequences[:, -(STEPS + 1):-1])
    # generate hands its logits out in float32: ours, float64, are compared rounded alike
    torch.testing.assert_close(torch.stack(decoded.logits, 1).float(),
                               torch.stack(generated.logits, 1))


@needs_5("torchparity decodes 4.x's Mamba by full recomputation, and generate's beam search "
          "keeps other n-best there")
@pytest.mark.parametrize("family", ["mamba", "cohere2"])
def test_the_built_in_search_reorders_these_caches_as_generate_does(family: str) -> None:
    model, inputs = _tiny(family)
    search = BeamSearch(BeamSettings(BEAMS), prompts=2)
    with torch.no_grad():
        decoded = teacher_forced(builtin_step(model), model, expand_prompt(inputs, BEAMS),
                                 STEPS, reorder=builtin_reorder(model), decide=search.decide)
        generated = model.generate(**inputs, do_sample=False, num_beams=BEAMS,
                                   num_return_sequences=BEAMS, max_new_tokens=STEPS,
                                   length_penalty=1.0, pad_token_id=0)
    pools = pool(search.history, decoded.tokens, decoded.parents, decoded.logits[0].shape[-1])
    nbest = [[list(hypotheses[i].tokens)
              for i in rescored(search.history, hypotheses, 1.0).argsort(descending=True)[:BEAMS]]
             for hypotheses in pools]
    assert nbest == generated[:, -STEPS:].reshape(2, BEAMS, STEPS).tolist()


def test_a_model_returning_no_cache_is_decoded_by_full_recomputation_saying_so(
        capsys, monkeypatch) -> None:
    monkeypatch.setattr(decoding, "_said", set())  # what an earlier test said is said again
    model, inputs = _tiny("roberta")
    # As transformers builds it by default: no decoder, so no cache.
    model.config.is_decoder = False
    for module in model.modules():
        if hasattr(module, "is_decoder"):
            module.is_decoder = False
    with torch.no_grad():
        decoded = teacher_forced(builtin_step(model), model, inputs, STEPS)
        whole = torch.cat((inputs["input_ids"], decoded.tokens), 1)
        mask = torch.cat((inputs["attention_mask"], torch.ones_like(decoded.tokens)), 1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate numbers left padding
        prompt = inputs["input_ids"].shape[1]
        # each step's logits are the last position's of the model run on everything so far
        expected = [model(input_ids=whole[:, :prompt + s], attention_mask=mask[:, :prompt + s],
                          position_ids=positions[:, :prompt + s], use_cache=False).logits[:, -1]
                    for s in range(STEPS + 1)]
    torch.testing.assert_close(torch.stack(decoded.logits, 1), torch.stack(expected, 1))
    said = capsys.readouterr().err.replace("\n  ", " ").splitlines()
    assert said.count("torchparity: RobertaForCausalLM: decoding by full recomputation: it "
                      "returns no cache") == 1
