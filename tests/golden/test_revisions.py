"""Goldens made with one revision of a model's library, checked under another: the default loss
reads only what both return by meaning (a cache in tuples or in an object is left out), so the
loss and every gradient are judged; an output renamed so that nothing is shared is "not
compared" and fails; goldens made before the factory decoded are checked on what they hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchparity.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

# One attention layer that returns its keys and values as a cache, in the form the revision
# ``FORM`` gives: tuples of tensors (transformers 4.x), an object (5.x), or under another name.
MODELS = '''
import torch
import torch.nn.functional as F

FORM = {form!r}


class Cache:
    """A cache object: what a comparison cannot walk into."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True)
                     .transpose(1, 2).flatten(-2))
        if FORM == "tuples":
            return {{"logits": y, "past_key_values": ((k, v),)}}
        if FORM == "object":
            return {{"logits": y, "cache": Cache(k, v)}}
        return {{"renamed": y}}


def step(model, tokens, state):
    x = tokens[0] if state is None else torch.cat((state, tokens[..., None].float() / 8
                                                 * torch.ones(1, 1, 16)), 1)
    return model(x)["logits"], x


def layer():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    return Layer(), (x,)


def decoding_layer():
    model, inputs = layer()
    return {{"model": model, "inputs": inputs, "step": step}}
'''


def _write(folder: Path, form: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "models.py"
    path.write_text(MODELS.format(form=form))
    return path


def _run(command: str, source: Path, entry: str, golden: Path, *args: str
         ) -> tuple[int, list[dict]]:
    report = golden.parent / f"{command}.json"
    extra = ["--json", str(report)] if command == "check" else []
    status = main([*command.split(), "--model", f"{source}:{entry}", "--golden-dir",
                   str(golden), *extra, *args])
    rows = json.loads(report.read_text())["results"] if report.exists() else []
    return status, rows


BACKENDS = ("--backend", "manual", "--backend", "sdpa", "--dtype", "fp32")


def test_a_cache_in_tuples_then_in_an_object_leaves_the_loss_and_gradients_judged(tmp_path):
    golden = tmp_path / "golden"
    assert _run("golden update", _write(tmp_path / "a", "tuples"), "layer", golden)[0] == 0
    summary = json.loads((golden / "models.layer" / "loss.json").read_text())
    assert summary["loss"]["default projection of"] == ["output.logits"]

    status, rows = _run("check", _write(tmp_path / "b", "object"), "layer", golden, *BACKENDS)

    assert status == 0, [r["explain"] or r["reason"] for r in rows if not r["ok"]]
    judged = [r for r in rows if r["output"] in ("loss", "grads")]
    assert len(judged) == 6  # reference, manual and sdpa
    assert {r["verdict"] for r in judged} <= {"identical", "within"}


def test_outputs_that_share_no_tensor_are_not_compared_and_fail(tmp_path, capsys):
    golden = tmp_path / "golden"
    assert _run("golden update", _write(tmp_path / "a", "object"), "layer", golden)[0] == 0

    status, rows = _run("check", _write(tmp_path / "b", "renamed"), "layer", golden, *BACKENDS)

    assert status == 1
    assert {r["output"]: r["verdict"] for r in rows if r["backend"] == "manual"
            and r["dtype"] == "fp64"} == dict.fromkeys(("outputs", "loss", "grads"),
                                                       "not compared")
    assert all(r["verdict"] == "not compared" and not r["ok"] for r in rows)
    loss = next(r for r in rows if r["output"] == "loss")
    assert "the model returned no tensor at output.logits" in loss["reason"]
    outputs = next(r for r in rows if r["output"] == "outputs")
    assert outputs["explain"].startswith("not compared: candidate and golden share no tensors")
    assert "identical" not in capsys.readouterr().out.split("FAIL", 1)[1]


def test_goldens_made_before_the_factory_decoded_are_checked_on_what_they_hold(tmp_path):
    golden = tmp_path / "golden"
    # The revision that did not decode names its factory as the later one does.
    earlier = _write(tmp_path / "a", "object")
    earlier.write_text(earlier.read_text() + "\n\ndef decoding_layer():\n    return layer()\n")
    assert _run("golden update", earlier, "decoding_layer", golden)[0] == 0
    later = _write(tmp_path / "b", "object")

    status, rows = _run("check", later, "decoding_layer", golden, *BACKENDS)

    assert status == 0, [r["explain"] or r["reason"] for r in rows if not r["ok"]]
    decode = [r for r in rows if r["output"] == "decode"]
    assert len(decode) == 3 and {r["verdict"] for r in decode} == {"n/a"}
    assert "have no decoding" in decode[0]["reason"]
    assert f"torchparity golden update --model {later}:decoding_layer" in decode[0]["reason"]
    assert {r["verdict"] for r in rows if r["output"] != "decode"} <= {"identical", "within"}

    assert _run("golden update", later, "decoding_layer", golden)[0] == 0
    status, rows = _run("check", later, "decoding_layer", golden, *BACKENDS)
    assert status == 0
    assert {r["verdict"] for r in rows if r["output"] == "decode"} <= {"identical", "within"}
