"""Which positions are padding, and which tensors they apply to: read from a model's 1/0
masks or given by its factory; an encoder-decoder's parts told apart by name, and a doubt
judging more, never less. The default loss leaves the padding out so that no gradient carries
it, not even a NaN there."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from torch import nn

from torchparity import tolerance
from torchparity.errors import UsageError
from torchparity.reference import rng, zoo
from torchparity.subject import Subject
from torchparity.subject.padding import Padding, from_inputs, padding_of
from torchparity.subject.running import projection_loss


def left_padded(batch: int = 2, length: int = 6, pad: int = 2) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, :pad] = 0
    return mask


def right_padded(batch: int = 2, length: int = 6, pad: int = 2) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, length - pad:] = 0
    return mask


def left_out(padding: Padding, path: str, shape: tuple[int, ...]) -> torch.Tensor | None:
    found = padding(path, torch.empty(shape))
    return None if found is None else found.mask


@pytest.mark.parametrize("mask", [left_padded(), left_padded().bool(), left_padded().float()])
def test_a_1_0_attention_mask_says_where_the_padding_is(mask):
    padding = from_inputs({"input_ids": torch.zeros(2, 6, dtype=torch.long),
                           "attention_mask": mask})
    assert torch.equal(left_out(padding, 'outputs["output.logits"]', (2, 6, 64)), mask == 0)
    assert torch.equal(left_out(padding, "output.hidden_states.1", (2, 6, 32)), mask == 0)
    assert left_out(padding, "output.loss", ()) is None
    assert padding.summary() == "2 of 12 positions are padding (per the inputs' attention_mask)"


@pytest.mark.parametrize("path, shape, positions", [
    ("output.cache.1.0", (2, 3, 6, 4), 2),  # a cache's keys: (batch, heads, positions, head_dim)
    ("output.cache.1.1", (2, 3, 6, 6), 2),  # its values, head_dim as long as the sequence
    ("output.attentions.0", (2, 4, 6, 6), 2),  # (batch, heads, queries, keys): by the queries
    ("output.1.0", (2, 4, 3, 6, 2), 3),  # a layout of more dimensions
    ("output.hidden_states.0", (2, 6, 6), 1),  # features as many as positions
    ("output.past_key_values.0.0", (2, 6, 6, 4), None),  # heads or positions: a doubt
])
def test_positions_are_found_by_meaning_whatever_dimension_holds_them(path, shape, positions):
    """Padding is a set of the sequence's positions, left out across every dimension before
    them (every head): the mask, True at padding, spread over the tensor's leading dimensions.
    The last dimension (features) never holds them; a tensor with two dimensions that could
    is judged whole, a doubt judging more."""
    mask = left_padded()
    padding = from_inputs({"input_ids": torch.zeros(2, 6, dtype=torch.long),
                           "attention_mask": mask})
    found = left_out(padding, path, shape)
    if positions is None:
        assert found is None
        return
    assert found.shape == shape[:positions + 1]
    index = [slice(None)] * len(found.shape)
    for head in itertools.product(*map(range, shape[1:positions])):
        index[1:positions] = head
        assert torch.equal(found[tuple(index)], mask == 0)


def test_a_tensor_whose_positions_are_not_the_sequences_is_judged_whole():
    padding = from_inputs({"attention_mask": left_padded()})
    assert left_out(padding, "output.cache.0.0", (2, 2, 3, 4)) is None  # a sliding window's
    assert left_out(padding, "output.cache.0.0", (4, 2, 6, 4)) is None  # another batch


@pytest.mark.parametrize("inputs", [
    (torch.zeros(2, 6, dtype=torch.long),),  # positional inputs carry no names
    {"input_ids": torch.zeros(2, 6), "attention_mask": torch.zeros(2, 1, 6, 6)},  # 4-D
    {"input_ids": torch.zeros(2, 6), "attention_mask": torch.full((2, 6), -1e9)},  # additive
])
def test_inputs_that_do_not_say_padding_leave_everything_judged(inputs):
    padding = from_inputs(inputs)
    assert not padding and left_out(padding, "output.logits", (2, 6, 4)) is None


def bart_like(decoder_length: int, decoder_mask: torch.Tensor | None = None) -> Padding:
    inputs = {"input_ids": torch.zeros(2, 6, dtype=torch.long),
              "attention_mask": right_padded(),
              "decoder_input_ids": torch.zeros(2, decoder_length, dtype=torch.long)}
    if decoder_mask is not None:
        inputs["decoder_attention_mask"] = decoder_mask
    return from_inputs(inputs, encoder_decoder=True)


def test_an_encoder_decoders_parts_are_told_apart_by_name_when_lengths_are_equal():
    padding = bart_like(decoder_length=6)  # the target has no padding
    encoder_pad = right_padded() == 0
    assert torch.equal(left_out(padding, 'outputs["output.encoder_last_hidden_state"]',
                                (2, 6, 32)), encoder_pad)
    assert torch.equal(left_out(padding.within("model.encoder.layers.0"), "output",
                                (2, 6, 32)), encoder_pad)
    # The decoder's cross-attention is the decoder's: its queries are target positions.
    assert left_out(padding.within("model.decoder.layers.0.encoder_attn"), "output",
                    (2, 6, 32)) is None
    # The logits name no part: only positions padded in both sequences would be left out.
    assert left_out(padding, 'outputs["output.logits"]', (2, 6, 64)) is None


def test_a_tensor_of_either_part_leaves_out_only_what_both_pad():
    decoder_mask = left_padded(pad=3)
    padding = bart_like(decoder_length=6, decoder_mask=decoder_mask)
    both = (right_padded() == 0) & (decoder_mask == 0)
    assert not both.any()  # right against left padding: nothing is padding in both
    assert left_out(padding, "output.logits", (2, 6, 64)) is None
    assert torch.equal(left_out(padding, "output.decoder_hidden_states.0", (2, 6, 32)),
                       decoder_mask == 0)
    same = bart_like(decoder_length=6, decoder_mask=right_padded())
    found = same("output.logits", torch.empty(2, 6, 64))
    assert torch.equal(found.mask, right_padded() == 0) and "in both" in found.reason


def test_shapes_tell_the_parts_apart_when_lengths_differ():
    padding = bart_like(decoder_length=4)
    assert left_out(padding, "output.logits", (2, 4, 64)) is None
    assert torch.equal(left_out(padding, "output.encoder_last_hidden_state", (2, 6, 32)),
                       right_padded() == 0)


def test_without_the_decoders_sequence_only_tensors_naming_the_encoder_are_matched():
    padding = from_inputs({"input_ids": torch.zeros(2, 6, dtype=torch.long),
                           "attention_mask": right_padded()}, encoder_decoder=True)
    assert left_out(padding, "output.logits", (2, 6, 64)) is None  # the target may be 6 long
    assert left_out(padding, "output.encoder_last_hidden_state", (2, 6, 32)) is not None


def test_the_zoos_encoder_decoder_masks_are_read():
    case = zoo.get("encdec-relative")
    batch = zoo.case_batch(case)
    padding = from_inputs(batch, encoder_decoder=True)
    assert [s.part for s in padding.sequences] == ["encoder", "decoder"]
    pad = batch["tgt_mask"] == 0
    assert torch.equal(left_out(padding, 'outputs["decoder.layers.0"]', (*pad.shape, 32)), pad)
    assert torch.equal(left_out(padding, 'outputs["logits"]', (*pad.shape, 64)),
                       pad & (batch["src_mask"] == 0))


def test_the_factorys_padding_comes_first():
    inputs = {"input_ids": torch.zeros(2, 6, dtype=torch.long), "attention_mask": left_padded()}
    mine = torch.zeros(2, 6, dtype=torch.bool)
    mine[0, -1] = True
    given = padding_of(mine, inputs)
    assert torch.equal(left_out(given, "output.logits", (2, 6, 4)), mine)
    assert given("output.logits", torch.empty(2, 6)).reason == "padding per the padding given"
    assert not padding_of(False, inputs)
    per_output = padding_of({"logits": mine}, inputs)
    assert torch.equal(left_out(per_output, 'outputs["output.logits"]', (2, 6, 4)), mine)
    # Other outputs keep what the inputs say; a module's tensors too.
    assert torch.equal(left_out(per_output, "output.hidden_states.0", (2, 6, 4)),
                       left_padded() == 0)
    assert torch.equal(left_out(per_output.within("model.norm"), "output", (2, 6, 4)),
                       left_padded() == 0)
    with pytest.raises(UsageError, match=r"padding for output.logits has shape \(2, 6\)"):
        per_output("output.logits", torch.empty(2, 5, 4))


@pytest.mark.parametrize("spec, message", [
    (torch.ones(2, 6, dtype=torch.long), "attention_mask == 0"),
    (torch.zeros(2, 1, 6, dtype=torch.bool), "shape (2, 1, 6)"),
    ({"logits": [0, 1]}, "got a list"),
    ("left", "got str"),
])
def test_a_factorys_padding_of_the_wrong_kind_is_one_line(spec, message):
    def factory():
        return {"model": nn.Linear(4, 4), "inputs": {"x": torch.zeros(2, 6, 4)},
                "padding": spec}

    with pytest.raises(UsageError, match="padding of factory") as error:
        Subject.load(factory)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_padding_survives_json():
    padding = bart_like(decoder_length=6, decoder_mask=right_padded())
    again = Padding.from_json(json.loads(json.dumps(padding.to_json())))
    assert again.summary() == padding.summary() and again.encoder_decoder
    assert torch.equal(left_out(again, "output.logits", (2, 6, 3)),
                       left_out(padding, "output.logits", (2, 6, 3)))


def test_the_default_loss_projects_the_unpadded_positions_and_no_nan_reaches_a_gradient():
    mask = left_padded(length=5)
    padding = from_inputs({"attention_mask": mask})
    values = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0))
    zeroed = values.masked_fill((mask == 0)[..., None], 0.0)
    garbage = values.masked_fill((mask == 0)[..., None], float("nan")).requires_grad_()
    loss = projection_loss({"output.logits": garbage}, padding)
    # The same weights as without padding, the padded terms dropped (independently: the sum of
    # the weighted unpadded values).
    weights = rng.symmetric(0, "loss.output.logits", (2, 5, 3), 1 / math.sqrt(30)).float()
    terms = zeroed.double() * weights.double()  # products of two float32 values: exact
    # A float32 dot product of n terms errs at most about n u sum|term| (the classic bound).
    bound = (terms.numel() + 1) * tolerance.unit_roundoff("fp32") * terms.abs().sum().item()
    assert abs(loss.item() - terms.sum().item()) <= bound
    assert abs(projection_loss({"output.logits": zeroed}).item() - terms.sum().item()) <= bound
    (grad,) = torch.autograd.grad(loss, garbage)
    assert grad.isfinite().all() and not grad[mask == 0].any()
    assert torch.equal(grad[mask == 1], weights[mask == 1])
