"""A handful of transformers families, one of each kind, through ``golden update`` and
``check`` of the unchanged model as ``hf:`` entries: a dense decoder, a mixture of experts
(grouped matmul, no float64 kernel) and a state-space model (no attention, a cache of its own).
The whole sweep is scripts/compatibility_sweep.py (docs/compatibility.md)."""

from __future__ import annotations

import json

import pytest

from torchparity.cli import main

pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mamba"])
def test_a_family_checks_clean_against_the_goldens_it_just_made(family, tmp_path):
    golden = ["--golden-dir", str(tmp_path / "golden")]
    assert main(["golden", "update", "--model", f"hf:{family}", *golden]) == 0
    report = tmp_path / "check.json"
    status = main(["check", "--model", f"hf:{family}", *golden, "--backend", "manual",
                   "--backend", "sdpa", "--dtype", "fp32", "--jobs", "1",
                   "--json", str(report)])
    rows = json.loads(report.read_text())["results"]
    assert status == 0, [r["explain"] or r["reason"] for r in rows if not r["ok"]]
    judged = {r["output"] for r in rows if r["verdict"] in ("identical", "within")}
    # decode-cache: the cached decoding against its full recompute, a state-space model's
    # float32 scan included
    assert {"outputs", "loss", "grads", "decode", "decode-cache"} <= judged
