"""Every attention backend available on the CPU matches a float64 run of every zoo case."""

from __future__ import annotations

import pytest
import torch

import torchparity as tp
from torchparity import backends
from torchparity.errors import BackendUnavailable, UsageError
from torchparity.reference import build_model, sequence_loss, zoo

CPU_BACKENDS = [name for name, reason in backends.available("cpu").items() if reason is None]


def _forward_and_grads(case_name: str, dtype: torch.dtype, backend: str, *, grads: bool):
    case = zoo.get(case_name)
    model = build_model(case.config, seed=0, dtype=dtype)
    batch = zoo.case_batch(case)
    with backends.use(backend), torch.set_grad_enabled(grads):
        logits = model(**batch)
        if not grads:
            return logits, None
        sequence_loss(logits, batch).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_cpu_offers_the_portable_backends() -> None:
    assert {"manual", "sdpa", "sdpa-math", "sdpa-flash", "flex"} <= set(CPU_BACKENDS)


@pytest.mark.parametrize("name", ["sdpa-efficient", "sdpa-cudnn"])
def test_cuda_only_backends_say_why_they_are_unavailable(name: str) -> None:
    reason = backends.available("cpu", torch.float32)[name]
    assert reason is not None and "CUDA" in reason


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case_name", zoo.names())
def test_backend_matches_float64(case_name: str, backend: str) -> None:
    # flex has no CPU backward; sdpa-flash cannot differentiate through a trainable bias.
    golden, golden_grads = _forward_and_grads(case_name, torch.float64, "manual", grads=True)
    baseline, baseline_grads = _forward_and_grads(case_name, torch.float32, "manual", grads=True)
    try:
        candidate, grads = _forward_and_grads(case_name, torch.float32, backend, grads=True)
    except BackendUnavailable:
        candidate, grads = _forward_and_grads(case_name, torch.float32, backend, grads=False)
    tp.assert_parity(candidate, golden, baseline=baseline, kind="forward")
    if grads is not None:
        tp.assert_parity(grads, golden_grads, baseline=baseline_grads, kind="grad")


def test_forced_backend_that_cannot_differentiate_says_so() -> None:
    case = zoo.get("llama-tiny")
    model = build_model(case.config)
    with backends.use("flex"), pytest.raises(BackendUnavailable, match="no backward"):
        model(**zoo.case_batch(case))


def test_cuda_only_backend_on_cpu_raises_instead_of_falling_back() -> None:
    case = zoo.get("llama-tiny")
    model = build_model(case.config)
    with backends.use("sdpa-efficient"), pytest.raises(BackendUnavailable,
                                                        match="needs a CUDA device"):
        model(**zoo.case_batch(case))


def test_unknown_backend_name_lists_the_known_ones() -> None:
    with pytest.raises(UsageError, match="choose one of manual, sdpa"), backends.use("fast"):
        pass


def test_config_field_selects_the_backend_and_use_overrides_it() -> None:
    config = zoo.get("llama-tiny").config.replace(attention_backend="sdpa-efficient")
    model = build_model(config)
    batch = zoo.case_batch(zoo.get("llama-tiny"))
    with pytest.raises(BackendUnavailable):
        model(**batch)
    with backends.use("manual"):
        model(**batch)


@pytest.mark.parametrize("case_name", ["llama-tiny", "encdec-relative"])
def test_reference_models_trace_as_one_graph(case_name: str) -> None:
    # A graph break (a value read from a tensor, an untraceable call) splits the compiled model
    # and costs speed; padded batches exercise the masked path, including empty-row handling.
    cfg = zoo.get(case_name).config
    model = build_model(cfg, seed=0)
    batch = zoo.make_batch(cfg, batch_size=2, seq_len=8, seed=0, padding="left")
    torch._dynamo.reset()
    with backends.use("sdpa"):
        explained = torch._dynamo.explain(model)(**batch)
    reasons = [r.reason.splitlines()[0] for r in explained.break_reasons]
    assert (explained.graph_count, reasons) == (1, [])
