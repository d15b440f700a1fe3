"""Decoding diagnosis of tiny random ``transformers`` models through the command line: eager
attention recorded on the base revision, sdpa diagnosed against it, is noise; a rotary base
changed in B is found at the prompt with real changes. Models that cannot decode by themselves,
and steps that return the wrong shape, get one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchparity.cli import main

pytest.importorskip("transformers")
# tiny models: one thread is faster
pytestmark = [pytest.mark.transformers, pytest.mark.usefixtures("single_thread")]

FACTORIES = '''
import os
import torch
import transformers

VOCAB = 64


def prompt():
    ids = torch.randint(3, VOCAB, (4, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is three tokens shorter, padded on the left
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def gpt2():
    torch.manual_seed(0)  # initializer_range 0.3: outputs depend on attention as if trained
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     vocab_size=VOCAB, initializer_range=0.3, bos_token_id=1,
                                     eos_token_id=2,
                                     attn_implementation=os.environ.get("TP_ATTENTION", "eager"))
    return transformers.GPT2LMHeadModel(config).eval(), prompt()


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB,
        initializer_range=0.3, rope_theta=float(os.environ.get("TP_ROPE_THETA", "10000")),
        attn_implementation=os.environ.get("TP_ATTENTION", "eager"))
    return transformers.LlamaForCausalLM(config).eval(), prompt()


def encoder_only():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, vocab_size=VOCAB)
    return transformers.BertModel(config).eval(), prompt()


def wrong_shape():
    model, inputs = llama()
    step = lambda model, tokens, state: (torch.zeros(4, 1, 1, VOCAB), state)  # noqa: E731
    return {"model": model, "inputs": inputs, "step": step}
'''


@pytest.fixture
def factories(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "hf_decoders.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "hf_decoders.py"


def _diagnose_against(factories: Path, family: str, monkeypatch, **env: str) -> tuple[int, dict]:
    trace = factories.parent / f"{family}.tptrace"
    monkeypatch.setenv("TP_ATTENTION", "eager")
    monkeypatch.delenv("TP_ROPE_THETA", raising=False)
    if not trace.exists():
        assert main(["record", f"{factories}:{family}", "--decode", "--steps", "6",
                     "-o", str(trace)]) == 0
    monkeypatch.setenv("TP_ATTENTION", "sdpa")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    report = factories.parent / "report.json"
    code = main(["diagnose", f"{factories}:{family}", "--against", str(trace),
                 "--json", str(report)])
    return code, json.loads(report.read_text())


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_eager_recorded_against_sdpa_is_noise(factories: Path, family: str, monkeypatch,
                                              capsys) -> None:
    code, report = _diagnose_against(factories, family, monkeypatch)
    assert code == 0, report["summary"]
    assert report["decode"]["first_step"] is None
    assert all(f["verdict"] == "near tie" for f in report["decode"]["flips"])
    out = capsys.readouterr().out
    if family == "llama":  # its eager attention in float64 makes NaN on left-padded rows
        for printed in (out.splitlines()[0], report["meta"]["notes"][0]):
            assert "no float64 golden" in printed or printed.startswith("golden: none")
            assert "gives NaN or inf at step 0 where A is finite" in printed
    else:
        assert report["meta"]["golden"] == "float64 copy of A on the CPU"


def test_a_changed_rotary_base_is_found_at_the_prompt_as_a_real_change(
        factories: Path, monkeypatch, capsys) -> None:
    code, report = _diagnose_against(factories, "llama", monkeypatch, TP_ROPE_THETA="100")
    decode = report["decode"]
    assert code == 1 and decode["first_step"] == 0, report["summary"]
    assert decode["first_module"] == "model.rotary_emb @ step 0"
    assert decode["flips"] and {f["verdict"] for f in decode["flips"]} == {"real change"}
    assert "model.rotary_emb.inv_freq" in report["meta"]["weights"]["changed"]
    capsys.readouterr()


@pytest.mark.parametrize(("entry", "message"), [
    ("encoder_only", "cannot decode a BertModel by itself; return a dict from the factory "
                     "with a 'step' key"),
    ("wrong_shape", "returned logits of shape (4, 1, 1, 64) float32 at step 0; it must "
                    "return (batch, vocab) or (batch, positions, vocab) floating logits"),
])
def test_a_model_without_a_usable_step_gets_one_line(factories: Path, capsys, entry: str,
                                                     message: str) -> None:
    assert main(["record", f"{factories}:{entry}", "--decode", "-o", "t.tptrace"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert entry in err[0]  # the factory is named
    assert not (factories.parent / "t.tptrace").exists()
