"""Users' models through ``golden update --model`` and ``check --model``: tiny random
``transformers`` models of four families pass on every CPU backend in fp32 and bf16; one planted
change fails naming the output and cell; a model that never calls SDPA has its backend cells
n/a with the reason; eager's attention weights against sdpa's None read as a structure
difference; bad entries get one line and their exit status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchparity import backends
from torchparity.cli import main

pytest.importorskip("transformers")
from tiny_transformers import ATTENTION_WEIGHTS, needs_5  # noqa: E402  (needs transformers)

pytestmark = pytest.mark.transformers

FAMILIES = ("gpt2", "llama", "bert", "bart")
CPU_BACKENDS = {"manual", "sdpa", "sdpa-math", "sdpa-flash", "flex", "hf-eager"}

FACTORIES = '''
import torch
import torch.nn.functional as F
import transformers

VOCAB = 64


def batch(length=8, pad=3, side="right"):
    """The second sequence padded: on the left, as decoder prompts are for batched generation
    (its first queries attend to nothing), or on the right, as encoder inputs are."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    if side == "left":
        mask[1, :pad] = 0
    else:
        mask[1, length - pad:] = 0
    return {"input_ids": ids * mask, "attention_mask": mask, "output_attentions": True}


def gpt2_config():
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB,
                                   n_positions=32, bos_token_id=1, eos_token_id=2)


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(gpt2_config()), batch(side="left")


def llama_config():
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=VOCAB, max_position_embeddings=64,
                                    bos_token_id=1, eos_token_id=2, pad_token_id=0)


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config()), batch(side="left")


def llama_positional():
    """Positional inputs (input_ids, attention_mask) name no mask: nothing says padding. (The
    base model: it does not generate, which needs keyword inputs.)"""
    model, inputs = llama()
    return model.model, (inputs["input_ids"], inputs["attention_mask"])


def llama_positional_padded():
    """The same, with the factory saying where the padding is."""
    model, (ids, mask) = llama_positional()
    return {"model": model, "inputs": (ids, mask), "padding": mask == 0}


def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, vocab_size=VOCAB,
                                     max_position_embeddings=32)
    return transformers.BertModel(config), batch()


def bart():
    torch.manual_seed(0)
    config = transformers.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1,
                                     encoder_attention_heads=4, decoder_attention_heads=4,
                                     encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
                                     max_position_embeddings=32, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
                                     forced_eos_token_id=None)
    inputs = batch()
    inputs["decoder_input_ids"] = batch(length=5, pad=0)["input_ids"]
    return transformers.BartForConditionalGeneration(config), inputs


class TinyAttention(torch.nn.Module):
    """One self-attention layer written by hand; ``sdpa`` picks the SDPA function."""

    def __init__(self, sdpa):
        super().__init__()
        self.sdpa = sdpa
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / 8 ** 0.5
            causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
            y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.out(y.transpose(1, 2).flatten(-2))


def hand_written(sdpa):
    torch.manual_seed(0)
    return TinyAttention(sdpa), (torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1)),)


def with_sdpa():
    return hand_written(True)


def without_sdpa():
    return hand_written(False)


def step_by_step(model, inputs, use_cache):
    """Position by position on growing prefixes (causal: the same values), or all at once."""
    (x,) = inputs
    if not use_cache:
        return model(x)
    return torch.stack([model(x[:, :t + 1])[:, -1] for t in range(x.shape[1])], 1)


def with_decode():
    model, inputs = hand_written(True)
    return {"model": model, "inputs": inputs, "decode": step_by_step}


def raises():
    raise RuntimeError("weights file not found")


def wrong_shape():
    return gpt2()[0]


def reseeded():
    torch.manual_seed(1)
    return transformers.GPT2LMHeadModel(gpt2_config()), batch(side="left")
'''

# Planted changes: each redefines one factory of a second models.py with the same entry name.
PLANTED = {
    "llama-norm-eps": ("llama", '''
def llama():
    torch.manual_seed(0)
    config = llama_config()
    config.rms_norm_eps = 1e-2
    return transformers.LlamaForCausalLM(config), batch(side="left")
'''),
    "llama-rotary-theta": ("llama", '''
def llama():
    torch.manual_seed(0)
    config = llama_config()
    config.rope_parameters = {"rope_type": "default", "rope_theta": 20000.0}
    return transformers.LlamaForCausalLM(config), batch(side="left")
'''),
    "gpt2-padding-mask": ("gpt2", '''
class LeakyGPT2(transformers.GPT2LMHeadModel):
    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        attention_mask = attention_mask.clone()
        attention_mask[1, 2] = 1  # the last padded key becomes visible to the real tokens
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def gpt2():
    torch.manual_seed(0)
    return LeakyGPT2(gpt2_config()), batch(side="left")
'''),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """models.py with every factory, and goldens of the families and hand-written models."""
    folder = tmp_path_factory.mktemp("user-models")
    (folder / "models.py").write_text(FACTORIES)
    entries = [f"{folder / 'models.py'}:{name}" for name in (
        *FAMILIES, "with_sdpa", "without_sdpa", "with_decode", "llama_positional",
        "llama_positional_padded")]
    assert main(["golden", "update", "--golden-dir", str(folder / "golden"),
                 *(arg for entry in entries for arg in ("--model", entry))]) == 0
    return folder


def check(models: Path, tmp_path: Path, entry: str, *args: str,
          source: Path | None = None) -> tuple[int, list[dict]]:
    """``check --model`` of ``entry`` in ``source`` (default: the shipped models.py)."""
    report = tmp_path / "check.json"
    status = main(["check", "--model", f"{source or models / 'models.py'}:{entry}",
                   "--golden-dir", str(models / "golden"), "--json", str(report), *args])
    return status, json.loads(report.read_text())["results"] if report.exists() else []


@needs_5(ATTENTION_WEIGHTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_families_pass_on_every_cpu_backend(models, tmp_path, capsys, family):
    status, rows = check(models, tmp_path, family, "--dtype", "fp32", "--dtype", "bf16")
    assert status == 0, [r["explain"] for r in rows if not r["ok"]]
    assert {(r["backend"], r["dtype"]) for r in rows if r["verdict"] != "n/a"} == {
        ("manual", "fp64"), *((b, d) for b in CPU_BACKENDS for d in ("fp32", "bf16"))}
    # Every backend cell judged the forward outputs against the golden, not a copy of itself.
    forward = [r for r in rows if r["output"] == "outputs" and r["backend"] in CPU_BACKENDS
               and r["dtype"] != "fp64"]
    assert {r["verdict"] for r in forward} <= {"identical", "within"}
    assert {r["verdict"] for r in forward if r["backend"] in {"sdpa", "sdpa-math"}} == {"within"}
    # Eager returns the attention weights that sdpa leaves None: a structure difference.
    eager = [r for r in forward if r["backend"] == "hf-eager"]
    assert all(r["ok"] and any("attentions" in s for s in r["structure"]) for r in eager)
    assert "structure differs (not a divergence)" in capsys.readouterr().out


@needs_5(ATTENTION_WEIGHTS)
def test_padded_positions_are_left_out_and_counted(models, tmp_path, capsys):
    status, rows = check(models, tmp_path, "llama", "--backend", "hf-eager", "--dtype", "fp32")
    assert status == 0, [r["explain"] for r in rows if not r["ok"]]
    # batch(side="left") pads 3 of the 8 positions of the second sequence.
    counted = {r["output"]: r["left_out"] for r in rows if r["backend"] == "hf-eager"}
    assert "3 of 16 positions of 1 tensor(s), padding per the inputs' attention_mask" in \
        counted["outputs"]
    assert "the default loss leaves the padding out" in counted["loss"]
    assert counted["grads"] is None  # a parameter's gradient has no positions
    out = capsys.readouterr().out
    assert "models.llama outputs: 3 of 16 positions" in " ".join(out.split())


@needs_5("its eager and sdpa attention agree on the queries that attend to nothing")
def test_a_factory_says_where_the_padding_is_when_the_inputs_cannot(models, tmp_path, capsys):
    # Positional inputs: eager's arbitrary values at the queries that attend to nothing are
    # judged, and eager against sdpa fails as if it were a bug.
    status, rows = check(models, tmp_path, "llama_positional", "--backend", "hf-eager",
                         "--dtype", "fp32")
    assert status == 1
    assert {r["output"] for r in rows if not r["ok"]} == {"outputs", "loss", "grads"}
    capsys.readouterr()
    status, rows = check(models, tmp_path, "llama_positional_padded", "--backend", "hf-eager",
                         "--dtype", "fp32")
    assert status == 0, [r["explain"] for r in rows if not r["ok"]]
    assert "padding per the factory's padding" in next(
        r["left_out"] for r in rows if r["output"] == "outputs")


def test_goldens_whose_default_loss_saw_other_positions_are_stale(models, tmp_path, capsys):
    changed = tmp_path / "changed" / "models.py"
    changed.parent.mkdir()
    changed.write_text(FACTORIES + '''

def llama():
    torch.manual_seed(0)
    return {"model": transformers.LlamaForCausalLM(llama_config()),
            "inputs": batch(side="left"), "padding": False}
''')
    status, _ = check(models, tmp_path, "llama", "--backend", "manual", source=changed)
    assert status == 2
    err = capsys.readouterr().err
    assert "default loss over other positions" in err and "golden update --model" in err


KV_CACHE_OFF_BY_ONE = '''
class OffByOne(transformers.GPT2LMHeadModel):
    def forward(self, input_ids=None, cache=None, position_ids=None, **kwargs):
        if cache is not None and cache.get_seq_length() > 0:
            start = cache.get_seq_length() + 1  # one position too far
            position_ids = torch.arange(start, start + input_ids.shape[1]).expand(
                input_ids.shape[0], -1)
        return super().forward(input_ids=input_ids, cache=cache, position_ids=position_ids,
                               **kwargs)


def gpt2():
    torch.manual_seed(0)
    return OffByOne(gpt2_config()), batch(side="left")
'''


@needs_5("the planted change takes 5.x's cache argument")
def test_a_kv_cache_position_off_by_one_fails_decoding_only(models, tmp_path):
    changed = tmp_path / "changed" / "models.py"
    changed.parent.mkdir()
    changed.write_text(FACTORIES + KV_CACHE_OFF_BY_ONE)
    status, rows = check(models, tmp_path, "gpt2", "--backend", "manual", "--dtype", "fp32",
                         source=changed)
    assert status == 1
    assert {r["output"] for r in rows if not r["ok"]} == {"decode", "decode-cache"}
    assert {r["dtype"] for r in rows if not r["ok"]} == {"fp64"}


def test_a_factorys_own_decode_step_is_compared_cached_and_recomputed(models, tmp_path):
    status, rows = check(models, tmp_path, "with_decode", "--backend", "sdpa",
                         "--dtype", "fp32")
    assert status == 0
    verdicts = {(r["backend"], r["dtype"], r["output"]): r["verdict"] for r in rows}
    assert verdicts["manual", "fp64", "decode-cache"] in {"identical", "within"}
    assert verdicts["sdpa", "fp32", "decode"] == "within"


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_a_planted_change_fails_naming_output_and_cell(models, tmp_path, capsys, planted):
    entry, change = PLANTED[planted]
    changed = tmp_path / "changed" / "models.py"  # same entry name, so the same goldens
    changed.parent.mkdir()
    changed.write_text(FACTORIES + change)
    status, rows = check(models, tmp_path, entry, "--backend", "manual", "--dtype", "fp32",
                         source=changed)
    assert status == 1
    failed = {(r["backend"], r["dtype"], r["output"]) for r in rows if not r["ok"]}
    assert ("manual", "fp64", "outputs") in failed
    assert {r["verdict"] for r in rows if not r["ok"]} == {"diverged"}
    assert f"FAIL models.{entry} reference fp64 cpu outputs: diverged" in capsys.readouterr().out


def test_a_model_without_sdpa_calls_has_its_backend_cells_na(models, tmp_path):
    status, rows = check(models, tmp_path, "without_sdpa", "--backend", "sdpa",
                         "--backend", "sdpa-math", "--dtype", "fp32")
    assert status == 0
    cells = [r for r in rows if r["dtype"] == "fp32"]
    assert cells and all(r["verdict"] == "n/a" and r["reason"] == backends.NO_SDPA_CALLS_REASON
                         for r in cells)


def test_a_hand_written_model_calling_sdpa_is_checked_on_each_backend(models, tmp_path):
    status, rows = check(models, tmp_path, "with_sdpa", "--backend", "sdpa-math",
                         "--backend", "sdpa-flash", "--dtype", "bf16")
    assert status == 0
    verdicts = {(r["backend"], r["output"]): r["verdict"] for r in rows if r["dtype"] == "bf16"}
    assert {verdicts[b, o] for b in ("sdpa-math", "sdpa-flash")
            for o in ("outputs", "loss", "grads")} <= {"identical", "within"}


def test_weights_of_another_init_are_init_changed(models, tmp_path, capsys):
    reseeded = tmp_path / "other" / "models.py"
    reseeded.parent.mkdir()
    reseeded.write_text(FACTORIES + "\n\ngpt2 = reseeded\n")
    status, rows = check(models, tmp_path, "gpt2", "--backend", "manual", "--dtype", "fp32",
                         source=reseeded)
    assert status == 1 and {r["verdict"] for r in rows} == {"init changed"}
    out = " ".join(capsys.readouterr().out.split())  # the lines wrapped at 80, joined
    # Made on this machine's instruction set: the values changed, not the machine.
    assert "torchparity golden update --model" in out and "their values changed" in out
    assert "tp.init_weights" not in out and out.count("FAIL models.") == 1


@pytest.mark.parametrize("entry, status, message", [
    ("{dir}/nowhere.py:gpt2", 2, "no file"),
    ("no_such_package.models:gpt2", 2, "cannot import no_such_package.models"),
    ("{dir}/models.py:missing", 2, "has no callable 'missing'"),
    ("{dir}/models.py:raises", 3, "raised RuntimeError: weights file not found"),
    ("{dir}/models.py:wrong_shape", 2, "must return (model, inputs)"),
])
def test_bad_entries_get_one_line(models, capsys, entry, status, message):
    spec = entry.format(dir=models)
    assert main(["check", "--model", spec, "--golden-dir", str(models / "golden")]) == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert spec.split(":")[-1] in err


def test_missing_goldens_and_unknown_dtypes_get_one_line(models, tmp_path, capsys):
    entry = f"{models / 'models.py'}:gpt2"
    assert main(["check", "--model", entry, "--golden-dir", str(tmp_path)]) == 2
    assert f"torchparity golden update --model {entry}" in capsys.readouterr().err
    assert main(["check", "--model", entry, "--golden-dir", str(models / "golden"),
                 "--dtype", "float8"]) == 2
    assert "unknown dtype 'float8'" in capsys.readouterr().err


def test_golden_update_leaves_unchanged_goldens_alone(models, capsys):
    assert main(["golden", "update", "--golden-dir", str(models / "golden"),
                 "--model", f"{models / 'models.py'}:bert"]) == 0
    assert "models.bert: outputs unchanged, loss unchanged, grads unchanged" in (
        capsys.readouterr().out)


def test_check_model_returns_the_report_in_python(models):
    import torchparity as tp

    cells = tp.model_cells(backends=["sdpa-math"], dtypes=["float32"])
    assert [str(cell) for cell in cells] == ["manual-fp64-cpu", "sdpa-math-fp32-cpu"]
    report = tp.check_model(f"{models / 'models.py'}:with_sdpa", cells=cells,
                            golden_dir=models / "golden")
    assert report.ok and report.explain().startswith("OK: 6 outputs")
    assert {(r.backend, r.output, r.verdict) for r in report.results if r.dtype == "fp32"} == {
        ("sdpa-math", "outputs", "within"), ("sdpa-math", "loss", "within"),
        ("sdpa-math", "grads", "within")}


USER_SUITE = '''
import pytest
import torchparity as tp

GOLDEN = {golden!r}


@pytest.mark.parametrize("cell", tp.model_cells(backends=["sdpa"], dtypes=["fp32"]), ids=str)
@pytest.mark.parametrize("entry", [{same!r}, {changed!r}], ids=["same", "changed"])
def test_model(model_parity, entry, cell):
    model_parity(entry, cell, golden_dir=GOLDEN)
'''


def test_the_pytest_fixture_gives_one_test_per_cell(models, tmp_path, pytester):
    changed = tmp_path / "changed" / "models.py"
    changed.parent.mkdir()
    changed.write_text(FACTORIES.replace("/ 8 ** 0.5", "/ 4 ** 0.5"))  # manual path rescaled
    pytester.makepyfile(test_suite=USER_SUITE.format(
        golden=str(models / "golden"), same=f"{models / 'models.py'}:without_sdpa",
        changed=f"{changed}:without_sdpa"))
    result = pytester.runpytest_inprocess("-q", "-rs", "-p", "no:cacheprovider")
    # The changed model fails in the reference cell; each model's sdpa cell is n/a (it never
    # calls SDPA): skipped with the reason, never passed.
    result.assert_outcomes(passed=1, failed=1, skipped=2)
    result.stdout.fnmatch_lines(["*test_model?changed-manual-fp64-cpu?*",
                                 "*FAIL models.without_sdpa reference fp64 cpu outputs: diverged*"])
    skipped = [line for line in result.stdout.lines if line.startswith("SKIPPED")]
    assert len(skipped) == 1 and skipped[0].startswith("SKIPPED [2] "), skipped  # one reason
    assert skipped[0].endswith(
        "sdpa-fp32-cpu: n/a: the model never called scaled_dot_product_attention"), skipped


def test_bench_times_each_backend_and_the_check_of_a_users_model(models, tmp_path):
    report = tmp_path / "bench.json"
    for entry in ("with_sdpa", "without_sdpa"):
        assert main(["bench", "--model", f"{models / 'models.py'}:{entry}", "--rounds", "2",
                     "--json", str(report), "--skip", "size",
                     *(["--skip", "check"] if entry != "with_sdpa" else [])]) == 0
        result = json.loads(report.read_text())
        rows = {r["backend"]: r for r in result["throughput"]}
        assert rows["manual"]["status"] == "ok" and rows["manual"]["tokens_per_s"] > 0
        assert rows["manual"]["first_step_s"] > 0
        if entry == "with_sdpa":
            assert rows["sdpa-math"]["status"] == "ok"
            (cost,) = result["check"]
            assert cost["model_check_ok"] and cost["cells"] == 5 and cost["ratio"] > 0
        else:
            assert rows["sdpa-math"]["reason"] == backends.NO_SDPA_CALLS_REASON
            assert result["check"] == []


def test_goldens_with_decoding_refuse_a_factory_without_it(models, tmp_path, capsys):
    changed = tmp_path / "changed" / "models.py"
    changed.parent.mkdir()
    changed.write_text(FACTORIES + "\n\ndef with_decode():\n    return hand_written(True)\n")
    status, _ = check(models, tmp_path, "with_decode", "--backend", "manual", source=changed)
    assert status == 2
    assert "were made with decoding, the factory now does not" in capsys.readouterr().err


@needs_5(ATTENTION_WEIGHTS)
def test_golden_verify_recomputes_a_users_model(models, tmp_path, capsys):
    golden_dir = str(models / "golden")
    assert main(["golden", "verify", "--golden-dir", golden_dir,
                 "--model", f"{models / 'models.py'}:llama"]) == 0
    assert "models.llama: ok (5 outputs reproduced)" in capsys.readouterr().out
    changed = tmp_path / "changed" / "models.py"
    changed.parent.mkdir()
    changed.write_text(FACTORIES + PLANTED["llama-norm-eps"][1])
    assert main(["golden", "verify", "--golden-dir", golden_dir,
                 "--model", f"{changed}:llama"]) == 1
    assert "models.llama: outputs diverged" in capsys.readouterr().out


DRAWN = '''
import torch
from torch import nn
import torchparity as tp


def layers():
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def drawn():
    g = torch.Generator().manual_seed(0)
    model = layers()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(generator=g)
    return {"model": model, "inputs": tp.random_tensor((2, 16), 1)}


def drawn_inputs():
    return {"model": tp.init_weights(layers(), 0), "inputs": torch.randn(2, 16)}


def redrawn():
    # torch's default init, then every value drawn again the same on every machine.
    model = layers()
    torch.nn.init.normal_(model[0].weight)
    return {"model": tp.init_weights(model, 0), "inputs": tp.random_tensor((2, 16), 1)}
'''


@pytest.mark.parametrize("factory, drawn", [("drawn", "0.weight and 3 more"),
                                            ("drawn_inputs", "inputs"),
                                            ("redrawn", None)])
def test_golden_update_warns_of_weights_or_inputs_drawn_by_torchs_cpu_normal(
        tmp_path, capsys, factory, drawn):
    """torch's CPU normal draws round differently by instruction set: goldens of such a
    factory read 'init changed' elsewhere, so the update says so in one warning."""
    path = tmp_path / "drawn_models.py"
    path.write_text(DRAWN)
    assert main(["golden", "update", "--model", f"{path}:{factory}", "--golden-dir",
                 str(tmp_path / "golden")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    if drawn is None:
        assert "warning" not in out
        return
    assert out.count("warning:") == 1
    assert (f"drawn_models.{factory}: warning: {drawn} come from torch's normal draws on the "
            "CPU") in out
    assert "tp.init_weights(model, seed) and tp.random_tensor(shape, seed)" in out
