"""Decoding diagnosis across real revisions, where code moves without changing meaning.

eole's cache refactor (``eole_decoders.py``, a stand-in for its LM test model) moves
``sliding_window`` from a keyword argument to an attribute with the same value and preallocates
the KV cache it keeps in ``self.layer_cache``: the change enters through that cache, one
position never written, and with only the cache write reverted nothing leaves the budget.

Two library releases (``release_decoders.py``, laid out as ``transformers`` 4.x and 5.x lay
out their attention and cache) rename the cache keyword, change the cache class and stop
passing arguments the attention never needed: no difference. A bug in the cached path of the
newer release is in the module's own code; a cache holding a never-written position is named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from release_decoders import NewCache, OldCache, StaleCache
from torch import nn

import torchparity as tp
from torchparity.diagnosis.core.arguments import argument_difference
from torchparity.diagnosis.core.capture import Uncopyable
from torchparity.diagnosis.core.state import held_state, state_difference
from torchparity.subject.factory import resolve_entry

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

HERE = Path(__file__).parent
EOLE_PROMPT = 9  # eole_decoders.PROMPT
RELEASE_PROMPT = 6  # release_decoders.PROMPT


def _factory(module: str, name: str) -> dict:
    return resolve_entry(f"{HERE / module}:{name}")()


def _recorded(tmp_path_factory, module: str, name: str) -> Path:
    made = _factory(module, name)
    path = tmp_path_factory.mktemp("revisions") / f"{name}.tptrace"
    return tp.record_decode(made["model"], made["inputs"], path, step=made["step"], steps=6,
                            progress=False)


def _against(trace: Path, module: str, name: str):
    made = _factory(module, name)
    return tp.diagnose_decode_against(trace, made["model"], made["inputs"], step=made["step"],
                                      progress=False)


@pytest.fixture(scope="module")
def eole_base(tmp_path_factory) -> Path:
    return _recorded(tmp_path_factory, "eole_decoders.py", "base")


@pytest.fixture(scope="module")
def old_release(tmp_path_factory) -> Path:
    return _recorded(tmp_path_factory, "release_decoders.py", "old")


def test_eole_pull_request_enters_through_its_kv_cache_not_sliding_window(eole_base) -> None:
    report = _against(eole_base, "eole_decoders.py", "pull_request")
    assert report.steps[0].verdict == "identical"
    assert report.first_step == 1
    assert report.first_module_label == "decoder.transformer_layers.0.self_attn @ step 1"
    entry = report.first_module.entry
    # The generator's step counts one too far: after step 1 A holds the prompt and one token,
    # B one position more, the one after the prompt never written.
    assert (entry.via, entry.argument) == ("state", "layer_cache.1.keys")
    assert entry.detail == (f"holds {EOLE_PROMPT + 2} positions in B, {EOLE_PROMPT + 1} in A; "
                            f"B never wrote position {EOLE_PROMPT} (all zeros)")
    assert "sliding_window" not in report.render(80)


def test_eole_pull_request_with_only_the_cache_write_reverted_is_noise(eole_base) -> None:
    report = _against(eole_base, "eole_decoders.py", "pull_request_concatenating")
    assert report.first_step is None, report.render(100)
    assert all(f.verdict == "near tie" for f in report.flips)


def test_a_newer_release_laid_out_otherwise_decodes_alike(old_release) -> None:
    report = _against(old_release, "release_decoders.py", "new")
    assert report.first_step is None and not report.flips, report.render(100)


def test_a_bug_in_the_newer_cached_path_is_the_modules_own_code(old_release) -> None:
    report = _against(old_release, "release_decoders.py", "new_scaled")
    assert report.first_step == 1
    assert report.first_module_label == "layers.0.self_attn @ step 1"
    entry = report.first_module.entry
    assert entry.via == "code", entry
    assert "The change is in the module's own code" in report.summary()
    # A's layers return (hidden,), B's the hidden state: compared by meaning, and diverged.
    layer = next(r for r in report.rows if r.module == "layers.0")
    assert layer.propagated.tensors and not layer.propagated.ok


def test_a_cache_of_the_newer_layout_with_a_stale_position_is_named(old_release) -> None:
    report = _against(old_release, "release_decoders.py", "new_stale")
    entry = report.first_module.entry
    assert report.first_module_label == "layers.0.self_attn @ step 1"
    assert (entry.via, entry.argument) == ("argument", "past_key_value.0.keys")
    assert entry.detail == (f"holds {RELEASE_PROMPT + 2} positions in B, {RELEASE_PROMPT + 1} "
                            f"in A; B never wrote position {RELEASE_PROMPT} (all zeros)")


# --------------------------------------------------------------------------------------------
# Arguments and state by meaning


X = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
KV = (torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4))


class Moved(nn.Module):
    """B's attention reading ``sliding_window`` from itself or its config."""

    def __init__(self, attribute: int | None = None, config: int | None = None) -> None:
        super().__init__()
        if attribute is not None:
            self.sliding_window = attribute
        if config is not None:
            self.config = type("Config", (), {"sliding_window": config})()


def _sig(*names: str, kwargs: bool = False, **defaults) -> list[tuple]:
    sig = [(n, "POSITIONAL_OR_KEYWORD") for n in names]
    sig += [(n, "POSITIONAL_OR_KEYWORD", d) for n, d in defaults.items()]
    return sig + ([("kwargs", "VAR_KEYWORD")] if kwargs else [])


@pytest.mark.parametrize(("a", "b", "b_module", "expected"), [
    # A keyword that became an attribute or a config value of the same value, or another.
    ((_sig("x", sliding_window=0), {"sliding_window": 0}), (_sig("x"), {}), Moved(0), None),
    ((_sig("x", sliding_window=0), {"sliding_window": 0}), (_sig("x"), {}), Moved(config=0),
     None),
    ((_sig("x", sliding_window=0), {"sliding_window": 4}), (_sig("x"), {}), Moved(0),
     ("sliding_window (B: self.sliding_window)", "A has 4, B has 0")),
    # Not passed in B: B reads its parameter's default.
    ((_sig("x", use_cache=False), {"use_cache": True}), (_sig("x", use_cache=True), {}), None,
     None),
    ((_sig("x", use_cache=False), {"use_cache": True}), (_sig("x", use_cache=False), {}), None,
     ("use_cache", "A has True, B has False")),
    # An argument B's forward does not name: its code cannot read it.
    ((_sig("x", cache_position=None), {"cache_position": X[0, 0]}), (_sig("x"), {}), None,
     None),
    ((_sig("x"), {}), (_sig("x", kwargs=True), {"position_ids": X[0, 0]}), None, None),
    # A parameter new in B, passed a value other than its default.
    ((_sig("x"), {}), (_sig("x", bias=None), {"bias": X[0]}), None,
     ("bias", "A has nothing, B has Tensor(3, 4) float32")),
    # The cache keyword renamed, the cache class changed, or a (keys, values) tuple become one.
    ((_sig("x", past_key_value=None), {"past_key_value": Uncopyable("DynamicCache")}),
     (_sig("x", past_key_values=None), {"past_key_values": Uncopyable("DynamicCache")}), None,
     None),
    ((_sig("x", layer_past=None), {"layer_past": KV}),
     (_sig("x", cache=None), {"cache": Uncopyable("EncoderDecoderCache")}), None, None),
])
def test_arguments_are_compared_by_what_the_module_reads(a, b, b_module, expected) -> None:
    found = argument_difference(a[0], ((X,), a[1]), b[0], ((X,), b[1]), b_module=b_module)
    assert (found and (found.argument, found.detail)) == expected


def test_caches_of_both_layouts_are_compared_by_the_positions_they_hold() -> None:
    old, new, stale = OldCache(), NewCache(), StaleCache()
    module = nn.Identity()
    for _ in range(3):
        for cache in (old, new, stale):
            for layer in range(2):
                cache.update(torch.ones(1, 2, 1, 4), torch.ones(1, 2, 1, 4), layer)
    a = held_state(module, (), {"past_key_value": old})
    assert sorted(a) == [f"kwargs.past_key_value.{i}.{part}" for i in range(2)
                         for part in ("keys", "values")]
    assert state_difference(a, held_state(module, (), {"past_key_values": new})) is None
    assert state_difference(a, held_state(module, (), {"past_key_values": stale})) == (
        "kwargs.past_key_value.0.keys",
        "holds 5 positions in B, 3 in A; B never wrote position 1, 3 (all zeros)")
