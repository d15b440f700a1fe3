"""compare on real Hugging Face outputs: ModelOutput, caches, and sdpa against eager attention.

Tiny random models built in code (no downloads); every comparison is three-way: a float64
eager golden, an eager baseline and the candidate in the dtype under test.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tiny_transformers import ATTENTION_WEIGHTS, FAMILIES, llama, needs_5, transformers
from torchparity.comparison import CACHE_RULE, StructureDifference, compare
from torchparity.subject import hf

pytestmark = pytest.mark.transformers


def _tokens() -> torch.Tensor:
    return torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def _forward(model: nn.Module, attn_implementation: str, dtype: torch.dtype) -> object:
    variant = copy.deepcopy(model).to(dtype)
    hf.set_attention(variant, attn_implementation)
    with torch.no_grad():
        return variant(_tokens(), output_attentions=True)


@needs_5("its cache is a tuple of tensors, compared as tensors")
def test_a_llama_forward_compared_with_itself_is_identical_and_its_cache_skipped() -> None:
    torch.manual_seed(0)
    model = llama().eval()
    with torch.no_grad():
        first, again = model(_tokens()), model(_tokens())
    caches = [key for key, value in first.items() if isinstance(value, transformers.Cache)]
    assert len(caches) == 1  # a DynamicCache, whatever this version names its field

    result = compare(first, again)

    assert result.verdict == "identical" and not result.structure_differs
    assert result.skipped == ((f'outputs["{caches[0]}"]', CACHE_RULE),)
    assert "Not compared: outputs[" in result.explain()


@needs_5(ATTENTION_WEIGHTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sdpa_differs_from_eager_in_structure_only_where_eager_returns_attention_weights(
    family: str, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    model = FAMILIES[family][0]().eval()
    golden = _forward(model, "eager", torch.float64)
    baseline = _forward(model, "eager", dtype)
    candidate = _forward(model, "sdpa", dtype)  # sdpa computes no attention weights
    expected = tuple(
        StructureDifference(
            f'outputs["{key}"][{layer}]',
            "missing",
            f"Tensor({', '.join(map(str, weights.shape))}) float64",
        )
        for key, value in golden.items()
        if key.endswith("attentions")
        for layer, weights in enumerate(value)
    )

    result = compare(candidate, golden, baseline)

    assert expected and result.structure == expected
    assert result.verdict == "within" and result.ok
    assert "Structure differs at" in result.explain()


def _cache_of(pairs: tuple) -> object:
    """A ``DynamicCache`` holding ``pairs`` (keys, values per layer), as a newer release
    returns what an older one returned as the tuple itself."""
    cache = transformers.DynamicCache()
    for layer, (keys, values) in enumerate(pairs):
        cache.update(keys.clone(), values.clone(), layer)
    return cache


@pytest.mark.parametrize("changed", [False, True], ids=["same", "changed"])
def test_a_cache_object_is_compared_by_its_tensors_with_the_tuple_it_replaced(changed) -> None:
    """Two releases of one model: the older returns its cache as a tuple of (keys, values)
    per layer, the newer as a ``DynamicCache`` holding the same tensors. Nothing differs in
    structure, and the tensors are judged: a changed key is found."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 8, 16, generator=generator)
    pairs = tuple((torch.randn(2, 2, 8, 4, generator=generator),
                   torch.randn(2, 2, 8, 4, generator=generator)) for _ in range(2))
    newer = _cache_of(pairs)
    if changed:
        dict(_layers(newer))["1.keys"][0, 0, 0, 0] += 1.0
    older_output = {"logits": logits, "past_key_values": pairs}
    newer_output = {"logits": logits, "past_key_values": newer}

    result = compare(newer_output, older_output)

    assert not result.structure and not result.skipped
    compared = {t.path for t in result.tensors}
    assert {f'outputs["past_key_values"][{layer}][{part}]' for layer in (0, 1)
            for part in (0, 1)} <= compared
    assert result.verdict == ("diverged" if changed else "identical")
    if changed:
        assert result.worst.path == 'outputs["past_key_values"][1][0]'


def _layers(cache: object) -> list:
    from torchparity.comparison.structure import cache_layers

    return list(cache_layers(cache).items())


def test_a_users_dataclass_cache_is_compared_by_its_fields() -> None:
    import dataclasses

    @dataclasses.dataclass
    class KVCache:
        keys: torch.Tensor
        values: torch.Tensor
        length: int

    generator = torch.Generator().manual_seed(1)
    keys, values = (torch.randn(1, 2, 4, 4, generator=generator) for _ in range(2))
    result = compare({"cache": KVCache(keys.clone(), values + 1, 4)},
                     {"cache": KVCache(keys, values, 4)})
    assert result.verdict == "diverged" and result.worst.path == 'outputs["cache"].values'
