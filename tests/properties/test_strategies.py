"""torchparity.strategies: valid draws only, every variant reachable, shrinking toward small,
padded batches that models accept, and reproducers that rerun a failure on their own."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

import torchparity as tp
from torchparity import strategies as tps
from torchparity.reference import build_model, variants
from torchparity.reference import config as config_module
from torchparity.reference.config import TransformerConfig

# For find() and nested tests: no example database, enough tries whatever profile is loaded.
QUICK = settings(database=None, deadline=None, max_examples=500,
                 suppress_health_check=[HealthCheck.too_slow])
# For "is it reachable at all": the first example found, not shrunk.
REACHABLE = settings(QUICK, phases=[Phase.generate])


@given(config=tps.configs(max_d_model=16, max_layers=1))
def test_drawn_configs_respect_the_limits_and_are_deterministic(config: TransformerConfig):
    assert config.d_model <= 16
    assert config.n_layers == 1 and config.n_encoder_layers <= 1
    assert config.dropout == 0.0
    assert TransformerConfig.from_dict(config.to_dict()) == config


@given(config=tps.configs(positions="rotary", activation=st.sampled_from(["gated-silu"]),
                          architectures=["encoder-decoder"]))
def test_pinned_fields_are_honoured_and_the_rest_drawn_around_them(config: TransformerConfig):
    assert config.positions == "rotary" and config.activation == "gated-silu"
    assert config.is_encoder_decoder
    assert config.rotary_dims <= config.dim_head


CHOICES = [(field, value) for field, values in (
    ("architecture", config_module.ARCHITECTURES),
    ("norm", config_module.NORMS),
    ("norm_placement", config_module.NORM_PLACEMENTS),
    ("activation", config_module.ACTIVATIONS),
    ("positions", config_module.POSITIONS),
    ("rotary_layout", config_module.ROTARY_LAYOUTS),
    ("sinusoidal_layout", config_module.SINUSOIDAL_LAYOUTS),
    ("parallel_residual", (True,)),
    ("shared_layernorm", (True,)),
    ("tie_embeddings", (True,)),
    ("n_kv_heads", (1, 2)),
) for value in values]


@pytest.mark.parametrize(("field", "value"), CHOICES)
def test_every_variant_of_the_reference_is_reachable(field: str, value) -> None:
    found = find(tps.configs(), lambda c: getattr(c, field) == value, settings=REACHABLE)
    assert getattr(found, field) == value


def test_a_failing_config_shrinks_to_the_smallest_one_with_the_failing_feature() -> None:
    found = find(tps.configs(), lambda c: c.positions == "alibi" and c.qkv_bias,
                 settings=QUICK)
    assert (found.n_layers, found.d_model, found.n_heads, found.d_ff) == (1, 8, 1, 8)
    assert found.architecture == "decoder" and found.n_kv_heads is None
    assert not (found.out_bias or found.ffn_bias or found.tie_embeddings)


def test_unknown_or_conflicting_pins_are_reported() -> None:
    with pytest.raises(ValueError, match="unknown TransformerConfig field.*n_head"):
        tps.configs(n_head=2)
    with pytest.raises(ValueError, match="architectures must be"):
        tps.configs(architectures=["encoder"])
    conflicting = tps.configs(architectures=["encoder-decoder"], parallel_residual=True)
    with pytest.raises(ValueError, match="conflict with the drawn ones.*parallel_residual"):
        find(conflicting, lambda c: True, settings=QUICK)


@settings(deadline=None)
@given(data=st.data())
def test_batches_run_through_the_model_they_were_drawn_for(data) -> None:
    config = data.draw(tps.configs(max_d_model=8, max_layers=1))
    batch = data.draw(tps.batches(config))
    with torch.no_grad():
        logits = build_model(config)(**batch)
    ids_key = "tgt_ids" if config.is_encoder_decoder else "input_ids"
    assert logits.shape == (*batch[ids_key].shape, config.vocab_size)
    assert logits.isfinite().all()


def _check_padding(ids: torch.Tensor, mask: torch.Tensor | None, side: str, vocab: int) -> None:
    if mask is None:
        assert side == "none" and bool((ids >= 1).all()) and bool((ids < vocab).all())
        return
    real = mask.bool()
    assert bool((ids[~real] == 0).all()) and bool((ids[real] >= 1).all())
    for row in mask.tolist():
        n = sum(row)
        expected = [0] * (len(row) - n) + [1] * n if side == "left" else [1] * n + [0] * (
            len(row) - n)
        assert row == expected


@given(config=tps.configs(architectures=["encoder-decoder"]), data=st.data(),
       side=st.sampled_from(tps.PADDINGS))
def test_rows_are_padded_on_the_drawn_side_with_zero_ids(config, data, side) -> None:
    batch = data.draw(tps.batches(config, padding=side, batch_size=3, seq_len=st.integers(2, 6)))
    _check_padding(batch["src_ids"], batch.get("src_mask"), side, config.source_vocab_size)
    _check_padding(batch["tgt_ids"], batch.get("tgt_mask"), side, config.vocab_size)
    full = [batch["tgt_ids"].shape[1]] * 3
    expected = batch["tgt_mask"].sum(-1).tolist() if "tgt_mask" in batch else full
    assert tps.lengths(batch)["tgt_ids"] == expected


def test_fully_padded_rows_are_drawn_unless_disabled() -> None:
    config = TransformerConfig()
    batch = find(tps.batches(config), lambda b: "attention_mask" in b
                 and bool((b["attention_mask"].sum(-1) == 0).any()), settings=REACHABLE)
    assert 0 in tps.lengths(batch)["input_ids"]

    @settings(QUICK, max_examples=50)
    @given(tps.batches(config, padding="left", allow_empty_rows=False))
    def no_empty_rows(batch):
        assert min(tps.lengths(batch)["input_ids"]) >= 1

    no_empty_rows()


def test_pad_rows_says_what_is_wrong() -> None:
    ids, mask = tps.pad_rows([[5, 6], [7]], "left", 3)
    assert ids.tolist() == [[0, 5, 6], [0, 0, 7]] and mask.tolist() == [[0, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="equal length"):
        tps.pad_rows([[5, 6], [7]], "none")
    with pytest.raises(ValueError, match="shorter than the longest row"):
        tps.pad_rows([[5, 6]], "right", 1)
    with pytest.raises(ValueError, match="side='middle' is invalid"):
        tps.pad_rows([[5]], "middle")


def test_dtypes_and_backends_are_those_that_run_here() -> None:
    backends = find(tps.attention_backends("cpu"), lambda name: True, settings=QUICK)
    assert backends == "manual"
    runnable = [n for n, why in tp.backends.available("cpu", torch.float32).items() if why is None]
    for name in runnable:
        assert find(tps.attention_backends("cpu"), lambda n, name=name: n == name,
                    settings=REACHABLE) == name
    assert find(tps.dtypes("cpu"), lambda d: True, settings=QUICK) == torch.float32


# --- reproducers ------------------------------------------------------------------------------


def check_complex_rotary_without_permutation(config, seed, batch):
    """A refactoring bug on purpose: rotary as a complex product (adjacent channel pairs), but
    the half-split model's q/k weights copied over without the layout permutation."""
    model = build_model(config, seed)
    twin = variants.swap_in(model, "rotary-complex")
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        golden = build_model(config, seed, dtype=torch.float64)(**batch)
        tp.assert_parity(twin(**batch), golden, model(**batch))


def test_a_failing_property_prints_a_reproducer_that_fails_on_its_own() -> None:
    @settings(QUICK, derandomize=True, max_examples=50)
    @given(data=st.data())
    def rotary_refactor_is_equivalent(data):
        config = data.draw(tps.configs(architectures=["decoder"], max_d_model=8, max_layers=1,
                                       positions="rotary", rotary_layout="half"))
        batch = data.draw(tps.batches(config, batch_size=1, seq_len=st.integers(2, 4)))
        tps.note_reproducer(check_complex_rotary_without_permutation,
                            dict(config=config, seed=0, batch=batch))

    with pytest.raises(AssertionError) as failure:
        rotary_refactor_is_equivalent()
    script = next(n for n in failure.value.__notes__ if n.startswith("# Reproducer"))
    assert "config = TransformerConfig(" in script and "torch.tensor([[" in script
    assert "def check_complex_rotary_without_permutation(" in script
    with pytest.raises(AssertionError, match="diverged"):
        exec(compile(script, "<reproducer>", "exec"), {})


def test_python_source_round_trips_what_properties_pass() -> None:
    values = dict(config=TransformerConfig(n_heads=2, positions="alibi"), dtype=torch.bfloat16,
                  batch={"input_ids": torch.tensor([[1, 2]]), "x": torch.tensor([0.5])},
                  plan=[("reorder", [1, 0]), ("append", [[3]])], chunk=None)
    namespace: dict = {}
    exec(tps.REPRODUCER_HEADER, namespace)
    for name, value in values.items():
        rebuilt = eval(tps.python_source(value), namespace)
        if isinstance(value, dict):
            assert rebuilt.keys() == value.keys()
            assert all(torch.equal(rebuilt[k], value[k]) and rebuilt[k].dtype == value[k].dtype
                       for k in value)
        else:
            assert rebuilt == value, name
    assert tps.config_source(TransformerConfig()) == "TransformerConfig()"
    assert dataclasses.replace(TransformerConfig(), d_model=16) == eval(
        tps.config_source(TransformerConfig(d_model=16)), namespace)
