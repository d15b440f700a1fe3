"""Goldens above the size threshold are kept as sketches: readable JSON with one line per
tensor, schema version 2 only when a sketch is inside, exact goldens read and judged as before,
a damaged sketch refused in one line; a user's model checked against sketched goldens passes
on every backend and a planted change fails naming the output."""

from __future__ import annotations

import json

import pytest
import torch

import torchparity as tp
from torchparity import sketching
from torchparity.cli import main
from torchparity.golden.store import (
    EXACT_SCHEMA_VERSION,
    SCHEMA_VERSION,
    GoldenCorrupt,
    GoldenStore,
)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"big": torch.randn(64, 80, generator=gen, dtype=torch.float64),
            "small": torch.randn(7, generator=gen, dtype=torch.float64),
            "ids": torch.arange(5000)}


def test_big_floating_tensors_are_stored_as_sketches(tmp_path, monkeypatch):
    monkeypatch.setenv(sketching.SKETCH_ABOVE_ENV, "1000")
    store = GoldenStore(tmp_path)
    tensors = _tensors()
    _, json_path = store.write("case", "out", tensors, {"kind": "forward"})
    golden = store.read("case", "out")
    assert isinstance(golden.tensors["big"], sketching.Sketch)
    assert torch.equal(golden.tensors["small"], tensors["small"])
    assert torch.equal(golden.tensors["ids"], tensors["ids"])  # integers stay exact
    assert golden.summary["schema_version"] == SCHEMA_VERSION
    sketched = golden.tensors["big"]
    assert sketched.same_values(sketching.sketch(tensors["big"], "big"))
    assert sketched.rms == pytest.approx(tensors["big"].square().mean().sqrt().item())
    text = json_path.read_text()
    line = next(line for line in text.splitlines() if '"big"' in line)
    assert '"sketch": ["countsketch-pcg64/1", 8192,' in line  # one line, as for exact ones
    # The golden judges a candidate as the full tensor would: its own values are identical.
    assert tp.compare({"big": tensors["big"]}, golden.tensors).verdict == "identical"


def test_exact_goldens_keep_schema_1_and_are_judged_against_sketched_candidates(tmp_path):
    store = GoldenStore(tmp_path)
    tensors = _tensors()
    store.write("case", "out", tensors)
    golden = store.read("case", "out")
    assert golden.summary["schema_version"] == EXACT_SCHEMA_VERSION
    candidate = {"big": sketching.sketch(tensors["big"].float(), "big")}
    baseline = {"big": sketching.sketch(tensors["big"].float(), "big")}
    assert tp.compare(candidate, golden.tensors, baseline).ok


def test_a_damaged_sketch_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(sketching.SKETCH_ABOVE_ENV, "1000")
    store = GoldenStore(tmp_path)
    _, json_path = store.write("case", "out", _tensors())
    summary = json.loads(json_path.read_text())
    summary["tensors"]["big"]["absmax"] *= 2
    json_path.write_text(json.dumps(summary))
    with pytest.raises(GoldenCorrupt, match=r"no longer matches its tensors \(big: absmax"):
        store.read("case", "out")


def test_a_bad_threshold_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv(sketching.SKETCH_ABOVE_ENV, "lots")
    (tmp_path / "m.py").write_text("import torch\n\ndef f():\n"
                                   "    return torch.nn.Linear(4, 4), (torch.ones(2, 4),)\n")
    assert main(["golden", "update", "--model", f"{tmp_path / 'm.py'}:f",
                 "--golden-dir", str(tmp_path / "golden")]) == 2
    assert "TORCHPARITY_SKETCH_ABOVE='lots' is not a number" in capsys.readouterr().err


transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.transformers

LLAMA = '''
import torch
import transformers


def config():
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    vocab_size=64, max_position_embeddings=64,
                                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                                    pad_token_id=0)


def inputs():
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config()), inputs()
'''

PLANTED = {
    "norm epsilon x10 in one layer": '''
def llama():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config())
    model.model.layers[1].input_layernorm.variance_epsilon *= 10
    return model, inputs()
''',
    "rotary theta": '''
def llama():
    torch.manual_seed(0)
    changed = config()
    if hasattr(changed, "rope_parameters"):  # transformers 5
        changed.rope_parameters = {"rope_type": "default", "rope_theta": 5000.0}
    else:
        changed.rope_theta = 5000.0
    return transformers.LlamaForCausalLM(changed), inputs()
''',
}


@pytest.fixture(scope="module")
def sketched_goldens(tmp_path_factory):
    """A tiny Llama's goldens with every floating tensor of 256 elements or more sketched."""
    folder = tmp_path_factory.mktemp("sketched")
    (folder / "models.py").write_text(LLAMA)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(sketching.SKETCH_ABOVE_ENV, "256")
        assert main(["golden", "update", "--model", f"{folder / 'models.py'}:llama",
                     "--golden-dir", str(folder / "golden")]) == 0
        yield folder


def _check(folder, source, tmp_path, *args):
    report = tmp_path / "check.json"
    status = main(["check", "--model", f"{source}:llama", "--golden-dir",
                   str(folder / "golden"), "--json", str(report), *args])
    return status, json.loads(report.read_text())["results"]


def test_every_backend_passes_against_sketched_goldens(sketched_goldens, tmp_path):
    grads = json.loads((sketched_goldens / "golden" / "models.llama" / "grads.json").read_text())
    assert sum("sketch" in line for line in grads["tensors"].values()) >= 7
    status, rows = _check(sketched_goldens, sketched_goldens / "models.py", tmp_path,
                          "--dtype", "fp32", "--dtype", "bf16")
    assert status == 0, [r["explain"] for r in rows if not r["ok"]]
    judged = [r for r in rows if r["verdict"] in ("within", "identical")]
    assert {r["output"] for r in judged} >= {"outputs", "grads", "loss", "decode"}


@pytest.mark.parametrize("planted", sorted(PLANTED))
def test_a_planted_change_fails_against_sketched_goldens(sketched_goldens, tmp_path, planted):
    changed = tmp_path / "models.py"
    changed.write_text(LLAMA + PLANTED[planted])
    status, rows = _check(sketched_goldens, changed, tmp_path, "--backend", "manual",
                          "--dtype", "fp32")
    assert status == 1
    failed = {(r["dtype"], r["output"]) for r in rows if not r["ok"]}
    assert {("fp64", "outputs"), ("fp64", "grads")} <= failed
    assert {r["verdict"] for r in rows if not r["ok"]} == {"diverged"}
