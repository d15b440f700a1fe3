"""TransformerConfig rejects every invalid value and combination with one clear line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from torchparity.reference import TransformerConfig, build_model, zoo

INVALID = [
    (dict(architecture="encoder-only"), "architecture='encoder-only' is invalid: expected one of"),
    (dict(norm="batchnorm"), "norm='batchnorm' is invalid"),
    (dict(activation="swish"), "activation='swish' is invalid"),
    (dict(positions="rope"), "positions='rope' is invalid"),
    (dict(d_model=30, n_heads=4), "n_heads=4 is invalid: must divide d_model=30"),
    (dict(n_kv_heads=3), "n_kv_heads=3 is invalid: must divide n_heads=4"),
    (dict(rotary_dim=3), "rotary_dim=3 is invalid: must be even and at most head_dim=8"),
    (dict(positions="alibi", rotary_dim=4), "rotary_dim=4 is invalid: only applies with"),
    (dict(parallel_residual=True, norm_placement="post"), "parallel_residual=True is invalid"),
    (dict(shared_layernorm=True), "shared_layernorm=True is invalid: needs parallel_residual"),
    (dict(architecture="encoder-decoder"), "n_encoder_layers=0 is invalid: an encoder-decoder"),
    (dict(n_encoder_layers=2), "need architecture='encoder-decoder'"),
    (dict(dropout=1.5), "dropout=1.5 is invalid"),
    (dict(norm_eps=0.0), "norm_eps=0.0 is invalid"),
    (dict(d_ff=0), "d_ff=0 is invalid: expected a positive integer"),
    (dict(attention_backend="fast"), "attention_backend='fast' is invalid: expected one of"),
]


@pytest.mark.parametrize(("fields", "message"), INVALID, ids=[m[:30] for _, m in INVALID])
def test_invalid_config_names_the_field_and_what_is_allowed(fields, message) -> None:
    with pytest.raises(ValueError) as info:
        TransformerConfig(**fields)
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_config_round_trips_through_a_dict() -> None:
    for name in zoo.names():
        config = zoo.get(name).config
        assert TransformerConfig.from_dict(config.to_dict()) == config


def test_unknown_field_in_a_dict_is_named() -> None:
    with pytest.raises(ValueError, match="no field.*n_experts"):
        TransformerConfig.from_dict({"n_experts": 8})


def test_weights_are_a_function_of_config_and_seed_only() -> None:
    config = zoo.get("llama-tiny").config
    a, b, c = build_model(config, seed=0), build_model(config, seed=0), build_model(config, seed=1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                  strict=True):
        assert pa.equal(pb), name
        assert not pa.equal(pc), name


def test_bad_device_is_one_line_from_the_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torchparity.cli", "backends", "--device", "nowhere"],
        capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "not a torch device" in result.stderr
