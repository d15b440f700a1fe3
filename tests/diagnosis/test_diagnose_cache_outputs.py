"""A cache object in a model's outputs is diagnosed by the tensors it holds.

A transformers release that returns a ``DynamicCache`` holds the same tensors an older one
returned as ``((keys, values), ...)`` per layer: a diagnosis across the two finds nothing that
differs in structure, judges the cache's tensors, and reads a cache as it was when its module
returned it, not as later calls left it."""

from __future__ import annotations

import pytest
import torch
from cache_object_llamas import cache_object, cache_object_scaled_keys, tuples

import torchparity as tp
from torchparity.diagnosis.core.capture import Capture

# tiny models: one thread is faster
pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("single_thread")]


def test_a_cache_object_reads_as_the_tuples_it_replaced() -> None:
    (a, inputs), (b, _) = tuples(), cache_object()
    report = tp.diagnose(a, b, inputs, backward=False)
    assert not report.output.structure and not any(r.structure for r in report.rows), \
        report.render()
    assert report.output.verdict == "identical", report.render()
    assert "structure differs" not in report.render()


def test_a_changed_cache_value_diverges_at_its_path() -> None:
    """B scales its last layer's keys after its model returned: only the cache shows it, at
    ``past_key_values.1.0`` (layer 1, keys), and only in the module that scaled them."""
    (a, inputs), (b, _) = tuples(), cache_object_scaled_keys()
    report = tp.diagnose(a, b, inputs, backward=False)
    verdicts = {t.path: t.verdict for t in report.output.tensors}
    assert verdicts == {'outputs["output.logits"]': "identical",
                        **{f'outputs["output.past_key_values.{layer}.{part}"]':
                           "diverged" if (layer, part) == (1, 0) else "identical"
                           for layer in (0, 1) for part in (0, 1)}}, report.render()
    assert report.first_divergence.module == "", report.render()
    # The inner model returned the cache before it was scaled: it was read then.
    assert report.row("model.model").propagated.verdict == "identical", report.render()


def test_capture_copies_a_cache_when_its_module_returns_it() -> None:
    model, inputs = cache_object()
    with Capture(model, include="") as cap:
        cache = model(**inputs)["past_key_values"]
    keys = cache.layers[0].keys.clone()
    cache.layers[0].keys.mul_(2.0)  # a later step writes to the same object
    recorded = cap[""].outputs
    assert torch.equal(recorded["output.past_key_values.0.0"], keys)
    assert set(recorded) >= {f"output.past_key_values.{layer}.{part}"
                             for layer in (0, 1) for part in (0, 1)}
