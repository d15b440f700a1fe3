"""Divergence localisation: planted single-module changes are found at the exact module.

Each plant changes one module of B (a norm's eps, the rotary form of one layer, a mask leak in
one layer, a scale in one MLP); the expectation is the planted module's name, which the test
knows independently of the diagnosis.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable

import pytest
import torch
from torch import nn

import torchparity as tp
from torchparity.diagnosis.reports.diagnosis import DiagnosisReport
from torchparity.errors import UsageError
from torchparity.reference import build_model, sequence_loss, zoo
from torchparity.reference.attention import Attention, AttentionContext
from torchparity.reference.mlp import MLP
from torchparity.reference.variants import swap_in

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

# tiny models: one thread is faster
pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("single_thread")]

SCALE = 1 + 2.0**-10  # a planted scale far above fp32 noise, far below anything visible


# --- reference model plants ---------------------------------------------------------------------


class LeakyAttention(Attention):
    """Lets every query also see the next token: a mask that leaks one position."""

    def forward(self, x: torch.Tensor, ctx: AttentionContext, memory=None) -> torch.Tensor:
        q_len, k_len = ctx.q_positions.shape[-1], ctx.k_positions.shape[-1]
        allowed = torch.ones(q_len, k_len, dtype=torch.bool).tril(1)[None, None]
        mask = allowed if ctx.mask is None else (ctx.mask | allowed) & ctx.mask.any(-2, True)
        return super().forward(x, dataclasses.replace(ctx, mask=mask, causal=False), memory)


class ScaledMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * SCALE


def plant_eps(model: nn.Module) -> str:
    model.decoder.layers[1].attn_norm.eps = 1e-4
    return "decoder.layers.1.attn_norm"


def plant_rotary(model: nn.Module) -> str:
    attn = model.decoder.layers[0].attn
    attn.config = dataclasses.replace(attn.config, rotary_layout="interleaved")
    return "decoder.layers.0.attn"


def plant_mask_leak(model: nn.Module) -> str:
    model.decoder.layers[1].attn.__class__ = LeakyAttention
    return "decoder.layers.1.attn"


def plant_mlp_scale(model: nn.Module) -> str:
    model.decoder.layers[0].mlp.__class__ = ScaledMLP
    return "decoder.layers.0.mlp"


REFERENCE_PLANTS = [plant_eps, plant_rotary, plant_mask_leak, plant_mlp_scale]


@pytest.fixture(scope="module")
def llama() -> tuple[nn.Module, dict]:
    cfg = zoo.get("llama-tiny").config
    return build_model(cfg, seed=0), zoo.make_batch(cfg, batch_size=2, seq_len=12, seed=0)


def assert_localised(report: DiagnosisReport, planted: str) -> None:
    first = report.first_divergence
    assert first is not None, report.render()
    assert first.module == planted, report.render()
    index = report.rows.index(first)
    assert all(r.local is None or r.local.ok for r in report.rows[:index])
    assert first.propagated is not None and not first.propagated.ok
    assert report.output is not None and not report.output.ok
    grad = report.first_grad_divergence
    assert grad is not None and grad.module == planted, report.render()


@pytest.mark.parametrize("plant", REFERENCE_PLANTS, ids=lambda p: p.__name__)
def test_planted_change_in_reference_model_is_localised(plant: Callable, llama) -> None:
    model_a, batch = llama
    model_b = copy.deepcopy(model_a)
    planted = plant(model_b)
    report = tp.diagnose(model_a, model_b, batch, loss_fn=sequence_loss)
    assert_localised(report, planted)
    assert report.loss is not None  # an aggregate: a subtle change may stay inside its budget


# --- Hugging Face Llama plants ------------------------------------------------------------------


class NegatedRotaryAttention(modeling_llama.LlamaAttention):
    """Rotates the other way (sin negated): a rotary variant that is not the same function."""

    def forward(self, hidden_states, position_embeddings=None, *args, **kwargs):
        cos, sin = position_embeddings
        return super().forward(hidden_states, (cos, -sin), *args, **kwargs)


class ScaledLlamaMLP(modeling_llama.LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * SCALE


def hf_plant_eps(model: nn.Module) -> str:
    model.model.layers[1].input_layernorm.variance_epsilon = 1e-4
    return "model.layers.1.input_layernorm"


def hf_plant_rotary(model: nn.Module) -> str:
    model.model.layers[0].self_attn.__class__ = NegatedRotaryAttention
    return "model.layers.0.self_attn"


def hf_plant_mask_leak(model: nn.Module) -> str:
    model.model.layers[1].self_attn.is_causal = False  # sees the whole sequence
    return "model.layers.1.self_attn"


def hf_plant_mlp_scale(model: nn.Module) -> str:
    model.model.layers[0].mlp.__class__ = ScaledLlamaMLP
    return "model.layers.0.mlp"


@pytest.fixture(scope="module")
def hf_llama() -> tuple[nn.Module, dict]:
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids}


@pytest.mark.parametrize("plant", [hf_plant_eps, hf_plant_rotary, hf_plant_mask_leak,
                                   hf_plant_mlp_scale], ids=lambda p: p.__name__)
def test_planted_change_in_hf_llama_is_localised(plant: Callable, hf_llama) -> None:
    model_a, inputs = hf_llama
    model_b = copy.deepcopy(model_a)
    planted = plant(model_b)
    report = tp.diagnose(model_a, model_b, inputs)
    assert_localised(report, planted)


# --- no change, refactors ----------------------------------------------------------------------


def test_identical_models_show_no_divergence(llama) -> None:
    model_a, batch = llama
    report = tp.diagnose(model_a, copy.deepcopy(model_a), batch, local="all")
    assert report.first_divergence is None and report.first_grad_divergence is None
    assert all(r.local.verdict == "identical" and r.propagated.verdict == "identical"
               for r in report.rows)
    assert report.output.verdict == "identical"
    assert not report.unmatched_a and not report.unmatched_b


def test_only_modules_whose_propagated_error_diverged_are_replayed(llama) -> None:
    model_a, batch = llama
    same = tp.diagnose(model_a, copy.deepcopy(model_a), batch)
    assert all(r.local is None and r.grad_local is None for r in same.rows)
    assert f"local errors of 0 of {len(same.rows)} module(s)" in same.render()
    model_b = copy.deepcopy(model_a)
    planted = plant_mlp_scale(model_b)
    # Forward only: the modules before the plant agree and are not replayed.
    lazy = tp.diagnose(model_a, model_b, batch, backward=False)
    full = tp.diagnose(model_a, model_b, batch, backward=False, local="all")
    assert lazy.first_divergence.module == full.first_divergence.module == planted
    replayed = [r for r in lazy.rows if r.local is not None]
    assert replayed == [r for r in lazy.rows if not r.propagated.ok]
    assert len(replayed) < len(lazy.rows)
    # Replayed rows get the same local verdicts as in a full diagnosis.
    by_module = {r.module: r for r in full.rows}
    assert [(r.module, r.local.verdict) for r in replayed] == [
        (r.module, by_module[r.module].local.verdict) for r in replayed]


def test_fused_qkv_refactor_aligns_and_stays_within_budget(llama) -> None:
    model_a, batch = llama
    report = tp.diagnose(model_a, swap_in(model_a, "fused-qkv"), batch, local="all")
    fused = [r for r in report.rows if r.how == "fused"]
    assert [r.module for r in fused] == ["decoder.layers.0.attn.in_proj",
                                         "decoder.layers.1.attn.in_proj"]
    assert fused[0].a_module == ("decoder.layers.0.attn.q_proj+decoder.layers.0.attn.k_proj"
                                 "+decoder.layers.0.attn.v_proj")
    assert all(r.local.ok and r.propagated.ok for r in fused)
    assert report.first_divergence is None and report.output.ok
    assert not report.unmatched_a and not report.unmatched_b


def test_b_in_bfloat16_is_judged_in_bfloat16_and_still_localised(llama) -> None:
    model_a, batch = llama
    model_b = copy.deepcopy(model_a).to(torch.bfloat16)
    assert tp.diagnose(model_a, model_b, batch, backward=False).first_divergence is None
    planted = plant_rotary(model_b)
    report = tp.diagnose(model_a, model_b, batch, backward=False)
    assert report.first_divergence.module == planted
    dtypes = {t.compute_dtype for r in report.rows if r.local is not None
              for t in r.local.tensors if t.compute_dtype}
    assert dtypes == {"bf16"}


def test_models_are_left_as_they_were(llama) -> None:
    model_a, batch = llama
    model_b = copy.deepcopy(model_a)
    plant_eps(model_b)
    before = {n: p.clone() for n, p in model_b.named_parameters()}
    rng = torch.get_rng_state()
    tp.diagnose(model_a, model_b, batch)
    assert all(p.grad is None for p in [*model_a.parameters(), *model_b.parameters()])
    assert all(torch.equal(p, before[n]) for n, p in model_b.named_parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model_b.modules())
    assert torch.equal(torch.get_rng_state(), rng)


def test_streaming_gives_the_same_verdicts(llama) -> None:
    model_a, batch = llama
    model_b = copy.deepcopy(model_a)
    planted = plant_mlp_scale(model_b)
    in_memory = tp.diagnose(model_a, model_b, batch, backward=False, local="all")
    streamed = tp.diagnose(model_a, model_b, batch, backward=False, stream=True, local="all")
    assert streamed.first_divergence.module == planted
    assert [(r.module, r.local.verdict, r.propagated.verdict) for r in streamed.rows] == [
        (r.module, r.local.verdict, r.propagated.verdict) for r in in_memory.rows]


def test_module_filter_limits_the_rows(llama) -> None:
    model_a, batch = llama
    model_b = copy.deepcopy(model_a)
    plant_eps(model_b)
    report = tp.diagnose(model_a, model_b, batch, backward=False,
                         include="decoder.layers.*", exclude="*.dropout")
    assert report.rows and all(r.module.startswith("decoder.layers.") for r in report.rows)
    assert not any(r.module.endswith("dropout") for r in report.rows)
    assert report.first_divergence.module == "decoder.layers.1.attn_norm"


def test_json_report_names_the_culprit(llama) -> None:
    model_a, batch = llama
    model_b = copy.deepcopy(model_a)
    planted = plant_rotary(model_b)
    data = json.loads(tp.diagnose(model_a, model_b, batch, backward=False).to_json())
    assert data["first_divergence"]["module"] == planted
    row = next(r for r in data["rows"] if r["module"] == planted)
    assert row["local"]["verdict"] == "diverged" and row["local"]["tensors"]


# --- usage errors ------------------------------------------------------------------------------


def test_usage_errors_are_one_line(llama) -> None:
    model_a, batch = llama
    with pytest.raises(UsageError, match="tuple of positional arguments or a dict"):
        tp.diagnose(model_a, model_a, [batch["input_ids"]])
    with pytest.raises(UsageError, match="not a torch.nn.Module"):
        tp.diagnose(model_a, "model", batch)
    dropout = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    with pytest.raises(UsageError, match="model.eval()"):
        tp.diagnose(dropout, dropout, (torch.ones(1, 2),))
    with pytest.raises(UsageError, match="backends must be a pair"):
        tp.diagnose(model_a, model_a, batch, backends=("manual",))
