"""``hf:`` entries: a tiny seeded model of any transformers causal-LM family, built the same
every time, with every kind of layer a hybrid has; bad entries get one line."""

from __future__ import annotations

import pytest
import torch

from torchparity.cli import main
from torchparity.errors import UsageError

pytest.importorskip("transformers")
from torchparity.subject import hf_families  # noqa: E402

pytestmark = pytest.mark.transformers


@pytest.mark.parametrize(("spec", "name", "attention", "dtype"), [
    ("hf:llama", "hf.llama", None, torch.float32),
    ("hf:qwen3_moe,attn=eager", "hf.qwen3_moe.eager", "eager", torch.float32),
    ("hf:bert-generation,dtype=bf16", "hf.bert_generation.bf16", None, torch.bfloat16),
    ("hf:gpt2,dtype=float64,attn=sdpa", "hf.gpt2.sdpa.fp64", "sdpa", torch.float64),
])
def test_an_entry_names_its_family_attention_and_dtype(spec, name, attention, dtype):
    entry = hf_families.parse(spec)
    assert (entry.name, entry.attention, entry.dtype) == (name, attention, dtype)


@pytest.mark.parametrize(("spec", "message"), [
    ("hf:lama", "'lama' is not a causal-LM family of transformers"),
    ("hf:llama,atn=eager", "unknown option 'atn=eager'"),
    ("hf:llama,dtype=fp8", "unknown dtype 'fp8'"),
    ("hf:", "names no family"),
    ("hf:llama,attn=nonesuch", "hf:llama:"),
    ("hf:/nonexistent/checkpoint", "has no config.json"),
])
def test_a_bad_entry_gets_one_line(spec, message, capsys):
    assert main(["golden", "update", "--model", spec, "--golden-dir", "/nonexistent"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_model_is_built_the_same_every_time():
    first, second = hf_families.tiny_model("qwen3_moe"), hf_families.tiny_model("qwen3_moe")
    assert first.state_dict().keys() == second.state_dict().keys()
    assert all(torch.equal(a, second.state_dict()[k]) for k, a in first.state_dict().items())
    # Attention scores are not negligible: the weights are not transformers' tiny init.
    q = first.model.layers[0].self_attn.q_proj.weight
    assert q.std() > 3 * first.config.initializer_range


def test_a_hybrid_has_each_kind_of_layer():
    model = hf_families.tiny_model("jamba")
    kinds = {type(layer).__name__ for layer in model.model.layers}
    assert any("Attention" in k for k in kinds) and any("Mamba" in k for k in kinds), kinds


def test_a_multimodal_family_is_its_language_model():
    model = hf_families.tiny_model("qwen3_5")
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    output = model(**hf_families.prompts(model.config))
    assert output.logits.shape[-1] == model.config.vocab_size


def test_the_prompts_are_left_padded_inside_the_vocabulary():
    model = hf_families.tiny_model("gpt2")
    prompts = hf_families.prompts(model.config)
    assert prompts["attention_mask"][1, :hf_families.PADDED].sum() == 0
    assert prompts["attention_mask"][0].all()
    assert int(prompts["input_ids"].max()) < model.config.vocab_size


def test_a_checkpoint_folder_loads_as_saved(tmp_path):
    saved = hf_families.tiny_model("llama")
    saved.save_pretrained(tmp_path)
    factory = hf_families.factory(f"hf:{tmp_path},attn=eager")
    loaded = factory()["model"]
    assert loaded.config._attn_implementation == "eager"
    assert all(torch.equal(p, saved.state_dict()[k]) for k, p in loaded.state_dict().items())


def test_an_unknown_family_is_a_usage_error():
    with pytest.raises(UsageError, match="did you mean llama"):
        hf_families.factory("hf:llamma")
