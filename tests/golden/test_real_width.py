"""A model of real width in the default suite: one layer of the Llama 3.2 1B shape (width 2048,
32 query and 8 key/value heads, llama3 rotary scaling, float32 norms and rotary table by
transformers' design). Its float64 golden runs module by module (no float64 copy), its
weight gradients and logits are big enough to be sketched at the shipped threshold, and every
cell must pass: the reference cell identical to its golden, the baseline of no cell degraded.

Its embedding lies halfway between float32 numbers, so the reference cell's rerun (weights
moved by one float64 rounding) rounds about half of them the other way at the first norm's
float32 cast, and every output then differs at float32 level: what happens by chance deep in
the 1B model, where one such rounding reaches every later layer."""

from __future__ import annotations

import json

import pytest

from torchparity import sketching, tolerance
from torchparity.cli import main

pytest.importorskip("transformers")

FACTORY = '''
import torch
from torchparity.bench.real_size import llama


def one_layer():
    model, inputs = llama(layers=1, vocab=4096, intermediate=1024, tokens=32)
    model.double()
    with torch.no_grad():
        weight = model.model.embed_tokens.weight
        below = weight.float()
        above = torch.nextafter(below, torch.tensor(float("inf")))
        weight.copy_((below.double() + above.double()) / 2)
    return model, inputs
'''


def test_one_layer_of_real_width_passes_every_cell_against_sketched_goldens(tmp_path,
                                                                              monkeypatch):
    monkeypatch.delenv(sketching.SKETCH_ABOVE_ENV, raising=False)
    (tmp_path / "models.py").write_text(FACTORY)
    entry, golden_dir = f"{tmp_path / 'models.py'}:one_layer", tmp_path / "golden"
    assert main(["golden", "update", "--model", entry, "--golden-dir", str(golden_dir)]) == 0
    goldens = golden_dir / "models.one_layer"
    grads = json.loads((goldens / "grads.json").read_text())["tensors"]
    outputs = json.loads((goldens / "outputs.json").read_text())
    # The shipped threshold sketches the weights of width 2048 and the 32 x 4096 logits.
    assert tolerance.SKETCH.min_elements <= 32 * 4096
    assert sum("sketch" in line for line in grads.values()) >= 7
    assert "sketch" in outputs["tensors"]["output.logits"]
    assert "model.layers.*.input_layernorm" in outputs["islands"]["float32"]

    report = tmp_path / "check.json"
    status = main(["check", "--model", entry, "--golden-dir", str(golden_dir), "--backend",
                   "manual", "--backend", "sdpa", "--dtype", "fp32", "--json", str(report)])
    rows = json.loads(report.read_text())["results"]
    assert status == 0, [r["explain"] for r in rows if not r["ok"]]
    assert not [r for r in rows if r["baseline"]], [r["baseline"] for r in rows]
    # The reference cell reruns the golden's own computation: bit for bit (its decode-cache
    # row judges the cached decoding against the full recompute, which round differently).
    reference = {r["output"]: r["verdict"] for r in rows
                 if r["dtype"] == "fp64" and r["output"] != "decode-cache"}
    assert set(reference.values()) == {"identical"}, reference
