"""Attention backends against independent float64 math: the reference zoo, the attention
function itself, and any model's ``scaled_dot_product_attention`` calls inside ``use()``."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as sdpa_imported_by_name

import torchparity as tp
from torchparity import backends
from torchparity.errors import BackendUnavailable, UsageError
from torchparity.reference import build_model, sequence_loss, zoo
from torchparity.subject import hf

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


def _explicit_attention(q, k, v, *, mask=None, bias=None, scale=None, causal=False):
    """Attention written out in float64: the reference no backend shares code with.

    GQA repeats key/value heads; a query row that sees no key gives zeros."""
    q, k, v = (t.double() for t in (q, k, v))
    k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias.double()
    visible = torch.ones(scores.shape, dtype=torch.bool)
    if causal:
        visible &= torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if mask is not None:
        visible &= mask
    probs = scores.masked_fill(~visible, -math.inf).softmax(dim=-1)
    probs = torch.where(visible.any(dim=-1, keepdim=True), probs, 0.0)
    return probs @ v


# --- backends on the reference zoo -----------------------------------------------------------


def test_cpu_offers_the_portable_backends() -> None:
    assert {"manual", "sdpa", "sdpa-math", "sdpa-flash", "flex"} <= set(CPU_BACKENDS)


@pytest.mark.parametrize("name", ["sdpa-efficient", "sdpa-cudnn"])
def test_cuda_only_backends_say_why_they_are_unavailable(name: str) -> None:
    reason = backends.available("cpu", torch.float32)[name]
    assert reason is not None and "CUDA" in reason


@functools.cache
def _golden_and_baseline(case_name: str):
    # The golden runs the zoo model on PyTorch's math kernel in float64, not on the manual
    # path, so the manual baseline is judged against math it does not share.
    return (_forward_and_grads(case_name, torch.float64, "sdpa-math", grads=True),
            _forward_and_grads(case_name, torch.float32, "manual", grads=True))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case_name", zoo.names())
def test_backend_matches_float64(case_name: str, backend: str) -> None:
    # flex has no CPU backward; sdpa-flash cannot differentiate through a trainable bias.
    (golden, golden_grads), (baseline, baseline_grads) = _golden_and_baseline(case_name)
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
    # use() also installs the SDPA redirect, which torch.compile must trace through.
    cfg = zoo.get(case_name).config
    model = build_model(cfg, seed=0)
    batch = zoo.make_batch(cfg, batch_size=2, seq_len=8, seed=0, padding="left")
    torch._dynamo.reset()
    with backends.use("sdpa"):
        explained = torch._dynamo.explain(model)(**batch)
    reasons = [r.reason.splitlines()[0] for r in explained.break_reasons]
    assert (explained.graph_count, reasons) == (1, [])


@pytest.mark.parametrize("case_name", ["llama-tiny", "encdec-prenorm"])
def test_reference_model_counts_each_attention_call_once(case_name: str) -> None:
    # On an SDPA kernel the reference attention calls scaled_dot_product_attention itself;
    # that inner call must neither be redirected again nor counted twice.
    cfg = zoo.get(case_name).config
    per_forward = cfg.n_layers + (cfg.n_encoder_layers + cfg.n_layers) * cfg.is_encoder_decoder
    model = build_model(cfg, seed=0)
    for backend in ("manual", "sdpa-math"):
        with torch.no_grad(), backends.use(backend) as intercepted:
            model(**zoo.case_batch(zoo.get(case_name)))
        assert intercepted.calls == per_forward, backend


# --- the attention function against explicit float64 math ------------------------------------


def _attention_inputs(feature: str, *, seed: int = 0) -> dict[str, object]:
    """q, k, v (batch 2, 4 query heads, 5 positions, head dim 8) and one feature's arguments."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads = 2 if feature == "gqa" else 4
    q = torch.randn(2, 4, 5, 8, generator=gen)
    k, v = (torch.randn(2, kv_heads, 5, 8, generator=gen) for _ in range(2))
    padding = torch.ones(2, 1, 5, 5, dtype=torch.bool)
    padding[1, ..., :2] = False  # the second sequence is left-padded by two keys
    padding[1, :, 0] = False  # and its first query sees nothing: a zero row
    bias = torch.randn(1, 4, 5, 5, generator=gen)
    extra = {
        "plain": {},
        "causal": {"causal": True},
        "mask": {"mask": padding},
        "causal-mask": {"mask": padding, "causal": True},
        "bias-mask": {"mask": padding, "bias": bias},
        "gqa": {"causal": True},
        "scale": {"scale": 0.3, "mask": padding},
    }[feature]
    return {"q": q, "k": k, "v": v, **extra}


ATTENTION_FEATURES = ["plain", "causal", "mask", "causal-mask", "bias-mask", "gqa", "scale"]


@pytest.mark.parametrize("feature", ATTENTION_FEATURES)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_attention_matches_explicit_float64(backend: str, feature: str) -> None:
    args = _attention_inputs(feature)
    golden = _explicit_attention(**args)
    baseline = backends.attention(**args, backend="manual")
    candidate = backends.attention(**args, backend=backend)
    tp.assert_parity(candidate, golden, baseline=baseline, kind="forward")


# --- any model's scaled_dot_product_attention calls ---------------------------------------------


def _sdpa_arguments(feature: str) -> tuple[tuple[torch.Tensor, ...], dict[str, object],
                                           dict[str, object]]:
    """(q, k, v), the keywords of one SDPA call with ``feature``, and the same call in the
    keywords of :func:`_explicit_attention`."""
    args = _attention_inputs("gqa" if feature in ("gqa", "5d") else "plain")
    qkv = (args["q"], args["k"], args["v"])
    mask = _attention_inputs("mask")["mask"]
    bias = _attention_inputs("bias-mask")["bias"]
    call, explicit = {
        "causal": ({"is_causal": True}, {"causal": True}),
        "bool-mask": ({"attn_mask": mask}, {"mask": mask}),
        "float-mask": ({"attn_mask": bias.masked_fill(~mask, -math.inf)},
                       {"mask": mask, "bias": bias}),
        "scale": ({"attn_mask": mask, "scale": 0.3}, {"mask": mask, "scale": 0.3}),
        "gqa": ({"is_causal": True, "enable_gqa": True}, {"causal": True}),
        "3d": ({"attn_mask": mask[1]}, {"mask": mask[1]}),
        "5d": ({"attn_mask": mask, "enable_gqa": True}, {"mask": mask}),
    }[feature]
    if feature == "3d":
        qkv = tuple(t[1] for t in qkv)
    if feature == "5d":  # two batch dims, the second broadcast on key and value
        qkv = (torch.stack((qkv[0], 2 * qkv[0])), qkv[1][None], qkv[2][None])
    return qkv, call, explicit


SDPA_FEATURES = ["causal", "bool-mask", "float-mask", "scale", "gqa", "3d", "5d"]
# Calls a kernel's own selection refuses, with the reason it gives.
REFUSED = {("sdpa-flash", "3d"): "4 dimensional", ("sdpa-flash", "5d"): "4 dimensional"}


@pytest.mark.parametrize("feature", SDPA_FEATURES)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_sdpa_call_runs_on_the_backend_and_matches_float64(backend: str, feature: str) -> None:
    qkv, call, explicit = _sdpa_arguments(feature)
    with backends.use("manual"):
        baseline = F.scaled_dot_product_attention(*qkv, **call)
    if (backend, feature) in REFUSED:
        with backends.use(backend), pytest.raises(BackendUnavailable,
                                                  match=REFUSED[backend, feature]):
            F.scaled_dot_product_attention(*qkv, **call)
        return
    with backends.use(backend) as intercepted:
        candidate = F.scaled_dot_product_attention(*qkv, **call)
        by_name = sdpa_imported_by_name(*qkv, **call)
    assert intercepted.calls == 2
    golden = _explicit_attention(*qkv, **explicit)
    tp.assert_parity(candidate, golden, baseline=baseline, kind="forward")
    assert torch.equal(by_name, candidate)  # the same call, however the function was reached


def test_sdpa_call_is_redirected_to_the_chosen_backend() -> None:
    # Each backend's own limits show on a plain SDPA call: proof the call reached it.
    q = k = v = torch.randn(1, 2, 4, 8, requires_grad=True)
    with backends.use("flex"), pytest.raises(BackendUnavailable, match="flex has no backward"):
        F.scaled_dot_product_attention(q, k, v)
    with backends.use("sdpa-efficient"), pytest.raises(BackendUnavailable, match="needs a CUDA"):
        sdpa_imported_by_name(q, k, v)
    trainable_bias = torch.zeros(1, 1, 4, 4, requires_grad=True)
    with backends.use("sdpa-flash"), pytest.raises(BackendUnavailable,
                                                    match="trainable additive bias"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=trainable_bias)


def test_flash_availability_is_decided_per_call() -> None:
    # The same backend in the same process refuses the call it cannot run and runs the next.
    q = k = v = torch.randn(1, 2, 4, 8, requires_grad=True)
    with backends.use("sdpa-flash") as intercepted:
        with pytest.raises(BackendUnavailable, match="sdpa-flash cannot run this call"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(4, 4,
                                                                          requires_grad=True))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert intercepted.calls == 2
    tp.assert_parity(out.detach(), _explicit_attention(q.detach(), k.detach(), v.detach(),
                                                       causal=True), kind="forward")


@pytest.mark.parametrize("backend", ["manual", "flex"])
def test_dropout_is_refused_in_one_line(backend: str) -> None:
    q = torch.randn(1, 2, 4, 8)
    with backends.use(backend), pytest.raises(BackendUnavailable) as refused:
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    assert "dropout_p=0.1" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("backend", ["manual", "sdpa-math"])
def test_kernel_error_in_an_intercepted_call_propagates(backend: str) -> None:
    # Key head dim 7 against query head dim 8: the kernel runs and fails. That is the model's
    # (or the backend's) bug, never a "cannot run here" that a test would skip.
    q, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 2, 4, 7)
    with backends.use(backend), pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v)


def test_nested_blocks_run_the_innermost_backend_and_both_count() -> None:
    qkv, call, _ = _sdpa_arguments("bool-mask")
    with backends.use("manual"):
        manual = F.scaled_dot_product_attention(*qkv, **call)
    with backends.use("flex") as outer:
        with backends.use("manual") as inner:
            nested = F.scaled_dot_product_attention(*qkv, **call)
        F.scaled_dot_product_attention(*qkv, **call)
    assert (outer.calls, inner.calls) == (2, 1)
    assert torch.equal(nested, manual)
    with backends.use("manual") as outer:
        with backends.use("manual") as inner:  # an equal block: leaving it leaves only it
            pass
        F.scaled_dot_product_attention(*qkv, **call)
    assert (outer.calls, inner.calls) == (1, 0)
    assert backends.current() == "manual" and not backends._blocks


def test_without_intercept_only_reference_models_follow_the_block() -> None:
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    with backends.use("flex", intercept=False) as block:
        F.scaled_dot_product_attention(q, q, q).sum().backward()  # PyTorch's own kernel
    assert block.calls == 0
    case = zoo.get("llama-tiny")
    with backends.use("sdpa-efficient", intercept=False), pytest.raises(
            BackendUnavailable, match="needs a CUDA device"):
        build_model(case.config)(**zoo.case_batch(case))
    with backends.use("flex", intercept=False), backends.use("manual") as inner:
        with pytest.raises(BackendUnavailable, match="flex has no backward"):
            with backends.use("flex", intercept=False):  # still inside an intercepting block
                F.scaled_dot_product_attention(q, q, q)
    assert inner.calls == 1


# --- whole models that call scaled_dot_product_attention -----------------------------------------


class NanoGPTAttention(nn.Module):
    """nanoGPT's CausalSelfAttention: one fused projection, F.scaled_dot_product_attention."""

    def __init__(self, d_model: int, n_heads: int, sdpa) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.n_heads, self.sdpa = n_heads, sdpa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
                   for y in self.c_attn(x).split(c, dim=2))
        y = self.sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class NanoGPT(nn.Module):
    """Pre-norm blocks over token and position embeddings; the first block calls SDPA through
    ``F``, the second through a name imported from torch.nn.functional."""

    def __init__(self, vocab: int = 64, d_model: int = 32, n_heads: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d_model), nn.Embedding(16, d_model)
        self.attn = nn.ModuleList(NanoGPTAttention(d_model, n_heads, sdpa) for sdpa in
                                  (F.scaled_dot_product_attention, sdpa_imported_by_name))
        self.ln = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(3))
        self.lm_head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for ln, attn in zip(self.ln, self.attn, strict=False):
            x = x + attn(ln(x))
        return self.lm_head(self.ln[-1](x))


def _nanogpt():
    torch.manual_seed(0)
    model = NanoGPT().eval()
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    # The float64 golden calls PyTorch's own SDPA (outside any use() block).
    return model, copy.deepcopy(model).double(), {"idx": idx}, 2


def _hf(family: str):
    import tiny_transformers  # skips the test where transformers is not installed

    torch.manual_seed(0)
    model = tiny_transformers.FAMILIES[family][0]()
    hf.set_attention(model, "sdpa")
    # The float64 golden runs Hugging Face's own eager attention, which calls no SDPA.
    golden = copy.deepcopy(model).double()
    hf.set_attention(golden, "eager")
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, 8, dtype=torch.long)
    attention_mask[1, 6:] = 0  # right padding: every query still sees a key
    inputs = {"input_ids": ids, "attention_mask": attention_mask, "use_cache": False}
    return model.eval(), golden.eval(), inputs, tiny_transformers.LAYERS


MODELS = {"nanogpt": _nanogpt, "hf-llama": lambda: _hf("llama"), "hf-gpt2": lambda: _hf("gpt2")}


def _logits_and_grads(model: nn.Module, inputs: dict, *, grads: bool):
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grads):
        out = model(**inputs)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        if not grads:
            return logits, None
        ids = inputs.get("idx", inputs.get("input_ids"))
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", [b for b in CPU_BACKENDS if b != "sdpa"])
@pytest.mark.parametrize("model_name", [
    pytest.param(name, marks=[pytest.mark.transformers] if name.startswith("hf-") else [])
    for name in MODELS])
def test_sdpa_model_matches_float64_on_every_backend(model_name: str, backend: str) -> None:
    fp32_model, golden_model, inputs, layers = MODELS[model_name]()
    grads = backend != "flex"  # flex has no backward pass on the CPU
    # float64 the default dtype, as in torchparity's own float64 runs: transformers 4.46's
    # GPT-2 fills its mask with float64's minimum in a tensor of that dtype.
    torch.set_default_dtype(torch.float64)
    try:
        golden, golden_grads = _logits_and_grads(golden_model, inputs, grads=grads)
    finally:
        torch.set_default_dtype(torch.float32)
    with backends.use("manual") as manual:
        baseline, baseline_grads = _logits_and_grads(fp32_model, inputs, grads=grads)
    with backends.use(backend) as intercepted:
        candidate, candidate_grads = _logits_and_grads(fp32_model, inputs, grads=grads)
    assert (manual.calls, intercepted.calls) == (layers, layers)
    assert intercepted.not_applicable_reason() is None
    tp.assert_parity(candidate, golden, baseline=baseline, kind="forward")
    if grads:
        tp.assert_parity(candidate_grads, golden_grads, baseline=baseline_grads, kind="grad")


@pytest.mark.slow
def test_compiled_models_run_on_the_backend_and_count_every_run() -> None:
    # The redirect is traced into the compiled graph; its counting replays on every run.
    model, _, inputs, layers = _nanogpt()
    compiled = torch.compile(model, backend="eager")
    torch._dynamo.reset()
    with torch.no_grad(), backends.use("manual") as intercepted:
        eager = model(**inputs)
        runs = [compiled(**inputs) for _ in range(3)]
    assert intercepted.calls == 4 * layers
    for out in runs:
        assert torch.equal(out, eager)
    with torch.no_grad(), backends.use("flex"), pytest.raises(BackendUnavailable,
                                                              match="dropout_p=0.5"):
        torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5),
                      backend="eager")(torch.randn(1, 2, 4, 8))


def test_a_compiled_model_counts_its_calls_without_recompiling() -> None:
    # Counting inside a compiled graph must neither be traced as a constant (dynamo would guard
    # on it and recompile at every call) nor leave the redirect to be compiled on its own.
    import torch._dynamo.utils

    model, _, inputs, layers = _nanogpt()
    torch._dynamo.reset()
    torch._dynamo.utils.clear_compilation_metrics()
    compiled = torch.compile(model, backend="eager", dynamic=False)
    with torch.no_grad():
        for backend in ("manual", "manual"):  # a new block each time, same backend
            with backends.use(backend) as intercepted:
                for _ in range(3):
                    compiled(**inputs)
            assert intercepted.calls == 3 * layers
    metrics = torch._dynamo.utils.get_compilation_metrics()
    assert [m.recompile_reason for m in metrics] == [None], [m.co_name for m in metrics]


@pytest.mark.transformers
def test_model_that_never_calls_sdpa_counts_zero_and_says_why() -> None:
    _, eager_model, inputs, _ = _hf("llama")  # Hugging Face eager attention: no SDPA call
    with torch.no_grad(), backends.use("sdpa-flash") as intercepted:
        eager_model(**inputs)
    assert intercepted.calls == 0
    assert intercepted.not_applicable_reason() == backends.NO_SDPA_CALLS_REASON
    assert backends.NO_SDPA_CALLS_REASON == "the model never called scaled_dot_product_attention"
