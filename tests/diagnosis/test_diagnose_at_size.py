"""diagnose at size: with tensors above the threshold sketched (forced low here), a recorded
trace keeps sketches of outputs and gradients but exact replay inputs, and both the in-process
diagnosis and the one against the trace name a planted norm epsilon; A's golden runs without a
float64 copy; A's side streams to disk by default when the models are big for the memory."""

from __future__ import annotations

import torch

import torchparity as tp
from torchparity import sketching
from torchparity.diagnosis.core import run
from torchparity.diagnosis.core.trace import open_trace
from torchparity.reference import build_model, sequence_loss, zoo


def _pair() -> tuple:
    cfg = zoo.get("llama-tiny").config
    a, b = build_model(cfg, seed=0), build_model(cfg, seed=0)
    b.decoder.layers[1].mlp_norm.eps = 1e-3
    return a, b, zoo.make_batch(cfg, batch_size=2, seq_len=8, seed=0)


def test_sketched_trace_still_names_the_planted_norm(tmp_path, monkeypatch):
    monkeypatch.setenv(sketching.SKETCH_ABOVE_ENV, "200")
    a, b, batch = _pair()
    path = tp.record(a, batch, tmp_path / "a.tptrace", loss_fn=sequence_loss)
    meta, store = open_trace(path)
    calls = [c["name"] for c in meta["calls"]]
    head = next(c for c in calls if c.endswith("lm_head"))
    assert isinstance(store.get(head, "golden_out")["output"], sketching.Sketch)
    assert isinstance(store.get(head, "param_grad")["weight"], sketching.Sketch)
    replayed = store.get_inputs(head)[0][0]  # replays are fed exact inputs
    assert isinstance(replayed, torch.Tensor) and replayed.numel() >= 200
    report = tp.diagnose_against(path, b, batch, loss_fn=sequence_loss)
    assert report.first_divergence.module == "decoder.layers.1.mlp_norm"
    in_process = tp.diagnose(a, b, batch, loss_fn=sequence_loss)
    assert in_process.first_divergence.module == "decoder.layers.1.mlp_norm"
    assert "no float64 copy" in in_process.meta.golden


def test_streaming_is_the_default_when_the_models_are_big_for_the_memory(monkeypatch):
    a, b, _ = _pair()
    size = sum(p.numel() * p.element_size() for m in (a, b) for p in m.parameters())
    monkeypatch.setattr(run, "_available_memory", lambda: 2 * size)
    assert run.stream_needed(a, b)
    monkeypatch.setattr(run, "_available_memory", lambda: 100 * size)
    assert not run.stream_needed(a, b)
