"""The decoding protocol: built-in steps decode as the models' own decoders do (the reference's
``greedy_decode``, ``transformers``' ``generate``), the loop feeds exactly the tokens it
reports, and a step that returns the wrong thing, or a model without a step, gets one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from torchparity.errors import UsageError
from torchparity.reference import build_model, greedy_decode, zoo
from torchparity.subject import Subject
from torchparity.subject.decoding import (
    builtin_step,
    read_tokens,
    recompute_step,
    teacher_forced,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster


@pytest.mark.parametrize("case", ["llama-tiny", "encdec-prenorm"])
def test_reference_steps_decode_as_the_reference_decoder(case: str) -> None:
    model = build_model(zoo.get(case).config, seed=0)
    batch = zoo.make_batch(model.config, batch_size=2, seq_len=6, seed=0,
                           padding="left" if case == "llama-tiny" else "none")
    with torch.no_grad():
        cached = teacher_forced(builtin_step(model), model, batch, 4)
        recomputed = teacher_forced(recompute_step(model), model, batch, 4)
        expected = greedy_decode(model, batch, steps=5)
    assert torch.equal(cached.tokens, expected.tokens[:, :4])
    assert torch.equal(recomputed.tokens, expected.tokens[:, :4])
    torch.testing.assert_close(torch.stack(cached.logits, 1), expected.logits)


def _left_padded() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the second prompt is two tokens shorter, padded on the left
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


@pytest.mark.transformers
@pytest.mark.parametrize("family", ["gpt2", "llama", "bart"])
def test_transformers_steps_decode_as_generate_does_on_left_padded_prompts(family: str) -> None:
    import tiny_transformers

    torch.manual_seed(0)
    model = getattr(tiny_transformers, "bart_generator" if family == "bart" else family)()
    model.eval()
    inputs = _left_padded()
    steps = 4
    with torch.no_grad():
        decoded = teacher_forced(builtin_step(model), model, inputs, steps)
        generated = model.generate(**inputs, do_sample=False, num_beams=1,
                                   max_new_tokens=steps + 1, output_logits=True,
                                   return_dict_in_generate=True, pad_token_id=0)
    new = generated.sequences[:, -(steps + 1):]
    assert torch.equal(decoded.tokens, new[:, :steps])
    torch.testing.assert_close(torch.stack(decoded.logits, 1), torch.stack(generated.logits, 1))
    if family != "bart":
        with torch.no_grad():
            recomputed = teacher_forced(recompute_step(model), model, inputs, steps)
        assert torch.equal(recomputed.tokens, decoded.tokens)


def test_the_loop_feeds_the_given_tokens_and_reports_them() -> None:
    seen = []

    def step(model, tokens, state):
        seen.append(tokens)
        n = 0 if state is None else state + 1
        return torch.eye(5)[None].expand(2, -1, -1)[:, n % 5], n  # (batch, vocab)

    given = torch.tensor([[4, 0, 3], [1, 1, 2]])
    decoded = teacher_forced(step, torch.nn.Identity(), "prompt", 3, given)
    assert seen[0] == "prompt" and all(t.shape == (2, 1) for t in seen[1:])
    assert torch.equal(torch.cat(seen[1:], 1), given) and torch.equal(decoded.tokens, given)
    greedy = teacher_forced(step, torch.nn.Identity(), "prompt", 3)
    assert greedy.tokens.tolist() == [[0, 1, 2], [0, 1, 2]]  # argmax of the step before
    assert len(greedy.logits) == 4 and greedy.steps == 3


def _step_returning(value):
    return lambda model, tokens, state: value


@pytest.mark.parametrize(("returned", "message"), [
    (torch.zeros(2, 5), "returned a Tensor(2, 5) at step 0; it must return a pair "
                        "(logits, state)"),
    ((torch.zeros(2, 3, 4, 5), None), "returned logits of shape (2, 3, 4, 5) float32 at step 0; "
                                      "it must return (batch, vocab) or (batch, positions, "
                                      "vocab) floating logits"),
    ((torch.zeros(2, 5, dtype=torch.long), None), "returned logits of shape (2, 5) int64"),
    (({"logits": torch.zeros(2, 5)}, None), "returned a dict as logits at step 0"),
])
def test_a_step_returning_the_wrong_thing_gets_one_line_naming_it(returned, message) -> None:
    with pytest.raises(UsageError, match="^the step ") as raised:
        teacher_forced(_step_returning(returned), torch.nn.Identity(), None, 2)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_step_changing_the_batch_is_named() -> None:
    def step(model, tokens, state):
        return torch.zeros(2 if state is None else 3, 5), 1

    with pytest.raises(UsageError, match="for 3 sequence.*at step 1, for 2 at the prompt"):
        teacher_forced(step, torch.nn.Identity(), None, 2)


@pytest.mark.transformers
def test_a_model_without_a_step_gets_one_line_naming_the_key() -> None:
    import tiny_transformers

    subject = Subject.load(lambda: (tiny_transformers.bert(), {"input_ids": torch.ones(1, 3,
                                                                                       dtype=int)}))
    with pytest.raises(UsageError) as raised:
        subject.stepper()
    text = str(raised.value)
    assert "cannot decode a BertModel by itself" in text and "a 'step' key" in text
    assert "\n" not in text
    given = Subject.load(lambda: {"model": torch.nn.Linear(2, 2), "inputs": (torch.ones(2),),
                                  "step": lambda m, t, s: (torch.zeros(1, 2), s)})
    assert given.stepper()(given.model, None, None)[0].shape == (1, 2)


def test_tokens_files_give_one_sequence_per_line(tmp_path: Path) -> None:
    path = tmp_path / "beams.txt"
    path.write_text("5 3 9 1\n\n2, 7, 4\n")
    assert read_tokens(path).tolist() == [[5, 3, 9], [2, 7, 4]]
    assert read_tokens(path, steps=2).tolist() == [[5, 3], [2, 7]]
    with pytest.raises(UsageError, match="sequence 1 has 3 token"):
        read_tokens(path, steps=4)
    path.write_text("5 x 9\n")
    with pytest.raises(UsageError, match="line 1: 'x' is not a token id"):
        read_tokens(path)
    with pytest.raises(UsageError, match="cannot read the tokens file"):
        read_tokens(tmp_path / "missing.txt")
