"""Families that once could not make their own goldens, or failed the check of them: a
mixture-of-experts model (its experts' grouped matmul has no float64 kernel) and a state-space
model (its cached decoding computes in float32) each pass the check of the goldens they just
made, the unchanged model judged against itself."""

from __future__ import annotations

import json

import pytest

from torchparity.cli import main

pytest.importorskip("transformers")
pytestmark = [pytest.mark.transformers, pytest.mark.slow]

CELLS = ["--backend", "manual", "--dtype", "fp32", "--jobs", "1"]


def _golden_then_check(entry: str, folder, report) -> tuple[int, list[dict]]:
    assert main(["golden", "update", "--model", entry, "--golden-dir", str(folder)]) == 0
    status = main(["check", "--model", entry, "--golden-dir", str(folder), *CELLS,
                   "--json", str(report)])
    return status, json.loads(report.read_text())["results"]


def test_a_mixture_of_experts_family_passes_the_check_of_its_goldens(tmp_path):
    status, rows = _golden_then_check("hf:qwen3_moe", tmp_path / "golden",
                                      tmp_path / "check.json")
    assert status == 0, [r["explain"] for r in rows if not r["ok"]]
    assert {r["output"] for r in rows if r["ok"]} >= {"outputs", "grads", "decode"}


def test_a_state_space_family_s_cached_decoding_passes_its_check(tmp_path):
    status, rows = _golden_then_check("hf:mamba", tmp_path / "golden", tmp_path / "check.json")
    assert status == 0, [r["explain"] for r in rows if not r["ok"]]
    decode_cache = [r for r in rows if r["output"] == "decode-cache"]
    assert decode_cache and all(r["ok"] for r in decode_cache)
