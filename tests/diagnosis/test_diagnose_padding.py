"""Diagnosing a padded batch: tiny ``transformers`` models, eager attention (A) against sdpa
(B), agree on every unpadded position, so the diagnosis finds no divergence and names no mask
argument (their masks differ in form only); a mask that lets one padded key reach real queries
still diverges and is named at the attention module; another argument that carries a change
is named rather than the mask beside it.

The expectations are independent of the diagnosis: the two implementations compute the same
attention on every query that attends to something, and the plants are known changes.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch import nn

import torchparity as tp
from tiny_transformers import bart, gpt2, llama
from torchparity.diagnosis.core.capture import read_caches
from torchparity.subject import hf
from torchparity.subject.running import in_cache
from torchparity.subject.trees import flatten_tensors

# tiny models: one thread is faster
pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("single_thread")]

PAD = 3  # padded positions of the second sequence


def batch(length: int = 8, side: str = "left") -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 64, (2, length), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, length, dtype=torch.long)
    if side == "left":
        mask[1, :PAD] = 0
    else:
        mask[1, length - PAD:] = 0
    return {"input_ids": ids * mask, "attention_mask": mask, "use_cache": False}


def eager_and_sdpa(build) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    a = build().eval()
    b = copy.deepcopy(a)
    hf.set_attention(a, "eager")
    hf.set_attention(b, "sdpa")
    return a, b


# Decoder prompts padded on the left (the first queries attend to nothing); the encoder of an
# encoder-decoder on the right, with a target as long as the source (its parts are told apart
# by name, not by shape).
FAMILIES = {
    "llama": (llama, lambda: batch(side="left")),
    "gpt2": (gpt2, lambda: batch(side="left")),
    "bart": (bart, lambda: {**batch(side="right"), "decoder_input_ids": batch()["input_ids"]}),
}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_eager_against_sdpa_on_a_padded_batch_finds_no_divergence(family, dtype):
    build, inputs = FAMILIES[family]
    a, b = eager_and_sdpa(build)
    report = tp.diagnose(a, b, inputs(), dtype=dtype)
    assert report.first_divergence is None, report.render()
    assert report.first_grad_divergence is None, report.render()
    assert report.output.ok and (report.loss is None or report.loss.ok), report.render()
    assert all(row.entry is None for row in report.rows) and "argument" not in report.summary()
    assert f"{PAD} of 16 positions are padding" in " ".join(report.meta.notes)


def leaks_one_padded_key(model: nn.Module) -> nn.Module:
    """B's LlamaModel builds a mask through which the padded key 0 of the second sequence
    reaches every real query after it."""
    import transformers.models.llama.modeling_llama as modeling

    build = modeling.create_causal_mask

    def leaky(**kwargs):
        mask = build(**kwargs).clone()
        mask[1, :, PAD:, 0] = True if mask.dtype == torch.bool else 0.0
        return mask

    class Leaky(type(model.model)):
        def forward(self, *args, **kwargs):
            with mock.patch.object(modeling, "create_causal_mask", leaky):
                return super().forward(*args, **kwargs)

    model.model.__class__ = Leaky
    return model


def test_a_padded_key_let_through_to_real_queries_is_named_at_the_attention():
    a, b = eager_and_sdpa(llama)
    report = tp.diagnose(a, leaks_one_padded_key(b), batch())
    first = report.first_divergence
    assert first is not None and first.module == "model", report.render()
    assert (first.entry.module, first.entry.argument) == ("model.layers.0.self_attn",
                                                          "attention_mask")
    real_queries, judged = 8 - PAD, 16 - PAD
    assert first.entry.detail.startswith(
        f"{real_queries} of {judged * 8} (query, key) pairs of judged queries attend otherwise")
    assert not report.output.ok


def scales_rotary_outside_a_module(model: nn.Module) -> nn.Module:
    """B's rotary table is computed outside any module and scaled by 1%: the layers are handed
    other position embeddings beside a mask of another form."""
    rotary = model.model.rotary_emb
    del model.model.rotary_emb
    model.model.rotary_emb = lambda x, position_ids: tuple(t * 1.01 for t in rotary(
        x, position_ids))
    return model


def test_the_argument_that_carries_a_change_is_named_not_the_mask_beside_it():
    a, b = eager_and_sdpa(llama)
    report = tp.diagnose(a, scales_rotary_outside_a_module(b), batch())
    first = report.first_divergence
    assert first is not None and first.module == "model", report.render()
    assert (first.entry.module, first.entry.argument) == ("model.layers.0.self_attn",
                                                          "position_embeddings.0")


def test_a_recorded_trace_keeps_its_padding(tmp_path):
    a, b = eager_and_sdpa(llama)
    inputs = batch()
    padding = torch.zeros(2, 8, dtype=torch.bool)
    padding[1, :PAD] = True
    trace = tp.record(a, inputs, tmp_path / "eager.tptrace", padding=padding)
    report = tp.diagnose_against(trace, b, inputs)
    assert report.first_divergence is None and report.output.ok, report.render()
    assert "(per the padding given)" in " ".join(report.meta.notes)
    judged_whole = tp.diagnose_against(trace, b, inputs, padding=False)
    assert not judged_whole.output.ok  # eager's values at the queries that see nothing


# With the model's default cache (no use_cache given) the outputs hold its keys and values,
# (batch, heads, positions, head_dim): those of padded positions are padding like the rest.
# family -> (builder, a real change planted through its config, which a release that rebuilds
# a model to switch its attention keeps, and the module where it enters: the activation made
# a ReLU).
CACHED = {
    "llama": (llama, {"hidden_act": "relu"}, "model.layers.0.mlp.act_fn"),
    "gpt2": (gpt2, {"activation_function": "relu"}, "transformer.h.0.mlp.act"),
}


def cached_batch() -> dict[str, torch.Tensor]:
    return {key: value for key, value in batch().items() if key != "use_cache"}


def checked(build, tmp_path, changed: dict | None = None) -> list:
    """``torchparity check``'s verdicts of the left-padded batch in its sdpa and eager cells,
    the goldens made of ``build``'s model and the cells run on one built with the ``changed``
    config: one entry at two revisions."""
    from torchparity.golden.model_check import check_subject, model_cells
    from torchparity.golden.store import GoldenStore
    from torchparity.golden.user_models import write_goldens
    from torchparity.subject import Subject

    def factory(config):
        def made():
            torch.manual_seed(0)
            return {"model": build(**config).eval(), "inputs": cached_batch()}
        made.__qualname__ = f"padded_{build.__name__}"
        return made

    store = GoldenStore(tmp_path)
    write_goldens(Subject.load(factory({})), store)
    return check_subject(Subject.load(factory(changed or {})), store,
                         model_cells(backends=["sdpa", "hf-eager"], dtypes=["fp32"]))


@pytest.mark.parametrize("family", CACHED)
def test_eager_against_sdpa_with_the_default_cache_passes_diagnose_and_check(family, tmp_path):
    build, _, _ = CACHED[family]
    a, b = eager_and_sdpa(build)
    with torch.no_grad():  # the outputs hold the cache's tensors
        assert any(in_cache(path) for path in flatten_tensors(read_caches(b(**cached_batch()))))
    report = tp.diagnose(a, b, cached_batch())
    assert report.first_divergence is None and report.output.ok, report.render()
    results = checked(build, tmp_path)
    assert results and all(r.ok for r in results), [r.explain for r in results if not r.ok]


@pytest.mark.parametrize("family", CACHED)
def test_a_real_change_with_the_default_cache_fails_diagnose_and_check(family, tmp_path):
    build, change, enters = CACHED[family]
    a, _ = eager_and_sdpa(build)
    b, _ = eager_and_sdpa(lambda: build(**change))
    hf.set_attention(b, "sdpa")
    report = tp.diagnose(a, b, cached_batch())
    assert report.first_divergence is not None and not report.output.ok
    assert report.first_divergence.module == enters, report.render()
    # The model changed: its float64 reference cell parts from the goldens (check exits 1).
    results = checked(build, tmp_path, change)
    failed = {(r.dtype, r.output) for r in results if not r.ok}
    assert {("fp64", "outputs"), ("fp64", "grads")} <= failed
