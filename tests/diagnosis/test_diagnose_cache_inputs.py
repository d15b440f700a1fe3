"""A cache object handed to a module is recorded as its tensors and rebuilt for each replay.

A transformers model run with ``use_cache=True`` hands a ``DynamicCache`` to every layer and
attention. A trace (``record``) keeps it by its class and its tensors, and each replay gets a
new copy, since a layer writes its keys into the cache it is handed: the layers stay
replayable against the trace, and where a layer's change enters through an argument the
entry stage names it. Only what cannot be rebuilt (an object of a class defined in a
function) is named. Families: Llama and Mistral (``hf_releases.py``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from hf_releases import llama_cached, mistral_cached

import torchparity as tp
from torchparity.comparison.structure import cache_layers
from torchparity.diagnosis.core.trace import DiskStore, ReplayUnavailable

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("single_thread")]

FAMILIES = {"llama": llama_cached, "mistral": mistral_cached}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def trace(request, tmp_path_factory) -> tuple[str, object]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TP_PLANT", "")
        model, inputs = FAMILIES[request.param]()
    path = tmp_path_factory.mktemp("cache_inputs") / f"{request.param}.tptrace"
    tp.record(model, inputs, path, backward=False)
    return request.param, path


def _against(trace, monkeypatch, plant: str):
    family, path = trace
    monkeypatch.setenv("TP_PLANT", plant)
    model, inputs = FAMILIES[family]()
    return tp.diagnose_against(path, model, inputs)


def test_layers_handed_a_cache_are_replayed_and_say_where_a_change_enters(trace, monkeypatch):
    report = _against(trace, monkeypatch, "mask")
    text = report.render()
    assert "not replayable" not in text and "could not be recorded" not in text, text
    first = report.first_divergence
    assert first.module == "model.layers.1", text
    assert (first.entry.module, first.entry.argument) == (
        "model.layers.1.self_attn", "attention_mask"), text
    # B's mask blocks key 0 for the last query of each of the 4 sequences, in each of the
    # (broadcast) heads it has: a count that follows from the plant, not from a run.
    assert first.entry.detail.startswith("4 of "), first.entry
    assert report.row("model.layers.1.self_attn").local.ok, text


def test_the_same_model_replays_alike_on_a_trace_with_caches(trace, monkeypatch):
    report = _against(trace, monkeypatch, "")
    assert report.first_divergence is None, report.render()
    assert "not replayable" not in report.render()


@dataclasses.dataclass
class Past:
    keys: torch.Tensor
    length: int


def _store(tmp_path) -> DiskStore:
    return DiskStore(tmp_path / "trace", writable=True)


def test_each_replay_gets_a_fresh_copy_of_a_cache_it_may_write_into(tmp_path) -> None:
    config = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=2)
    cache = transformers.StaticCache(config=config, max_cache_len=8)
    keys = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(0))
    cache.update(keys, -keys, 0, {"cache_position": torch.arange(3)})
    recorded = {name: t.clone() for name, t in cache_layers(cache).items()}
    store = _store(tmp_path)
    store.put_inputs("call", (), {"past": cache, "pair": (keys, -keys),
                                  "held": {"past": Past(keys, 3)}})
    (_, first) = store.get_inputs("call")
    assert type(first["past"]) is transformers.StaticCache
    first["past"].layers[0].keys.add_(1.0)  # a replay writes into its copy
    first["pair"][0].add_(1.0)
    (_, second) = store.get_inputs("call")
    assert cache_layers(second["past"]).keys() == recorded.keys()
    for name, tensor in recorded.items():
        assert torch.equal(cache_layers(second["past"])[name], tensor), name
    assert torch.equal(second["pair"][0], keys) and torch.equal(second["pair"][1], -keys)
    assert second["held"]["past"].length == 3 and torch.equal(second["held"]["past"].keys, keys)


def test_a_dynamic_cache_is_rebuilt_with_its_layers(tmp_path) -> None:
    cache = transformers.DynamicCache()
    keys = torch.randn(2, 2, 5, 8, generator=torch.Generator().manual_seed(1))
    for layer in range(2):
        cache.update(keys * (layer + 1), keys - layer, layer)
    store = _store(tmp_path)
    store.put_inputs("call", (cache,), {})
    (rebuilt,), _ = store.get_inputs("call")
    assert type(rebuilt) is transformers.DynamicCache
    assert rebuilt.get_seq_length() == 5
    held = cache_layers(rebuilt)
    assert set(held) == {f"{i}.{part}" for i in range(2) for part in ("keys", "values")}
    for layer in range(2):
        assert torch.equal(held[f"{layer}.keys"], keys * (layer + 1))
        assert torch.equal(held[f"{layer}.values"], keys - layer)


def test_only_what_cannot_be_rebuilt_is_named(tmp_path) -> None:
    class Local:  # defined in a function: no import path to rebuild it from
        def __init__(self) -> None:
            self.keys = torch.zeros(2)

    store = _store(tmp_path)
    store.put_inputs("call", (Local(),), {"cache": transformers.DynamicCache()})
    with pytest.raises(ReplayUnavailable, match="an input of type Local could not be recorded"):
        store.get_inputs("call")
