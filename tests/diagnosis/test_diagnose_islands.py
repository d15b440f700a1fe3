"""Parts of a model computed in a narrower dtype whatever the model's own (*islands*: a rotary
table of complex64 numbers built in float32, a softmax upcast to float32 only) are judged with
their own dtype's budget: the same code on both sides is no divergence, in float32 and in
float64 mode, and no hint sends a clean pair to float64. The expectations are the library's own:
eager and sdpa attention of one ``transformers`` model are the same math, and a change planted
in one module is found there."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchparity as tp

pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("single_thread")]
transformers = pytest.importorskip("transformers")


def llama4(attention: str) -> nn.Module:
    """A tiny Llama 4 text model, whose rotary table is ``torch.polar`` of float32 angles."""
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
        max_position_embeddings=64, num_local_experts=2, interleave_moe_layer_step=2,
        attn_implementation=attention)).eval()


def llama(attention: str) -> nn.Module:
    """A tiny Llama, whose eager softmax, norms and rotary table run in float32."""
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=64,
        attn_implementation=attention)).eval()


def twins(build: object) -> tuple[nn.Module, nn.Module]:
    eager, sdpa = build("eager"), build("sdpa")
    sdpa.load_state_dict(eager.state_dict())
    return eager, sdpa


def inputs() -> dict:
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "use_cache": False}


def test_a_complex_rotary_table_computed_alike_is_no_divergence() -> None:
    eager, sdpa = twins(llama4)
    report = tp.diagnose(eager, sdpa, inputs(), backward=False)
    assert report.exit_status == 0, report.render()
    # the complex table is judged, not skipped: a changed scale of it is found there
    scaled = copy.deepcopy(eager)
    scaled.model.rotary_emb.attention_scaling = 1.0001
    report = tp.diagnose(eager, scaled, inputs(), backward=False)
    assert report.first_divergence.module == "model.rotary_emb", report.render()


def test_float32_islands_send_no_clean_pair_to_float64_and_pass_there() -> None:
    eager, sdpa = twins(llama)
    report = tp.diagnose(eager, sdpa, inputs(), backward=False)
    assert report.exit_status == 0 and "--dtype fp64" not in report.summary(), report.render()
    report = tp.diagnose(eager, sdpa, inputs(), backward=False, dtype=torch.float64)
    assert report.exit_status == 0 and report.output.ok, report.render()
    # eager's softmax is the island the report names (sdpa's kernel computes in float64)
    assert "float32 at " in report.render(width=200) and \
        "model.layers.*.self_attn" in report.render(width=200), report.render()


def test_float64_mode_still_finds_a_change_outside_the_islands() -> None:
    eager, sdpa = twins(llama)
    # the MLP computes in the model's dtype: a change of it beyond float32's rounding (which
    # reaches it from the islands upstream) is named there
    sdpa.model.layers[1].mlp.down_proj.weight.data.mul_(1 + 1e-3)
    report = tp.diagnose(eager, sdpa, inputs(), backward=False, dtype=torch.float64)
    assert report.first_divergence is not None, report.render()
    assert report.first_divergence.module == "model.layers.1.mlp.down_proj", report.render()


def test_a_trace_keeps_the_islands_of_its_float64_run(tmp_path) -> None:
    eager, sdpa = twins(llama)
    trace = tp.record(eager, inputs(), tmp_path / "eager.tptrace", backward=False,
                      dtype=torch.float64)
    report = tp.diagnose_against(trace, sdpa, inputs())
    assert report.exit_status == 0, report.render()
