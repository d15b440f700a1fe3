"""A factory's decode golden as a beam search (its ``search`` key): the golden holds the search's
tokens and parents, every cell decodes along them, and the reference cell's cached decoding
against its full recompute along the same beams catches a cache whose reorder leaves the
values behind, at the first step whose reorder moves rows between hypotheses."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchparity.cli import main
from torchparity.golden.model_check import check_model
from torchparity.golden.store import GoldenStore
from torchparity.reference import build_model, zoo
from torchparity.subject.factory import resolve_entry

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

BEAMS = 4
TOYS = Path(__file__).parents[1] / "diagnosis" / "toy_beam_decoders.py"
first_moving_reorder = resolve_entry(f"{TOYS}:first_moving_reorder")
ValuesLeftBehind = resolve_entry(f"{TOYS}:ValuesLeftBehind")


def searching() -> dict:
    cfg = zoo.get("llama-tiny").config
    return {"model": build_model(cfg, seed=0), "search": {"beams": BEAMS},
            "inputs": zoo.make_batch(cfg, batch_size=2, seq_len=6, seed=0)}


def stale_values() -> dict:
    made = searching()
    made["model"].new_cache = ValuesLeftBehind
    return made


def updated(factory: str, golden_dir: Path) -> str:
    """The entry of a factory of this file, its goldens made by ``torchparity golden update
    --model``."""
    entry = f"{__file__}:{factory}"
    assert main(["golden", "update", "--model", entry, "--golden-dir", str(golden_dir)]) == 0
    return entry


def test_every_cell_decodes_along_the_golden_beam_search(tmp_path: Path) -> None:
    report = check_model(updated("searching", tmp_path), backends=["manual", "sdpa"],
                         dtypes=["fp32"], golden_dir=tmp_path)
    assert report.ok, report.explain()
    decoded = [r for r in report.results if r.output in ("decode", "decode-cache")]
    assert {r.output for r in decoded} == {"decode", "decode-cache"} and len(decoded) >= 3


def test_a_reorder_that_leaves_the_values_behind_fails_the_cached_decoding(
        tmp_path: Path) -> None:
    report = check_model(updated("stale_values", tmp_path), backends=["manual"],
                         dtypes=["fp32"], golden_dir=tmp_path)
    failed = [r for r in report.results if not r.ok]
    assert [r.output for r in failed] == ["decode-cache"], report.explain()
    golden = GoldenStore(tmp_path).read(report.results[0].case, "decode").tensors
    assert golden["parents"].shape == golden["tokens"].shape == (2 * BEAMS, 4)
    step = first_moving_reorder(golden["tokens"], golden["parents"])
    assert f"first step that differs: {step} (0 is the prompt)" in failed[0].explain


def test_a_search_key_that_is_no_search_gets_one_line(tmp_path: Path, capsys) -> None:
    factory = tmp_path / "bad.py"
    factory.write_text("import torch\n\ndef make():\n    return {'model': torch.nn.Linear(2, 2),"
                       " 'inputs': (torch.ones(2),), 'search': {'beam': 4}}\n")
    assert main(["check", "--model", f"{factory}:make", "--golden-dir", str(tmp_path)]) == 2
    assert "give a dict like {'beams': 4}" in capsys.readouterr().err
