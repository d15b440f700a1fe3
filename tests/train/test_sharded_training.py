"""A user's model trained sharded under torchrun (gloo, 2 ranks) and judged against the golden
trajectory and noise band of one process (``train --model ENTRY --nproc 2 --check``).

The expectations come from the shardings themselves: FSDP2, a DTensor tensor-parallel plan
and tensor parallel by hand compute one process's mathematics (reductions split across the
ranks change rounding only), so every step must be within the band; a column-parallel linear
that never sums its input's gradient over the ranks leaves the forward, and so the first
loss, as one process's, while the gradients it sends back are each rank's share: the run
must part at step 1 in a gradient norm. torch's ``clip_grad_norm_`` over hand-made slices
clips each rank by its own slices' norm: the run must part, after the first update. The runs
share the golden of ``sharded_lm.py:lm``, whose variants are one model and recipe in one
process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from torchparity.cli import main

HERE = Path(__file__).parent
ENTRY = f"{HERE / 'sharded_lm.py'}:lm"
STEPS = "12"


def train_cli(*args: str) -> int:
    return main(["train", "--model", ENTRY, "--steps", STEPS, *args])


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    """The one-process golden trajectory and noise band, made once by the command."""
    folder = tmp_path_factory.mktemp("goldens")
    assert train_cli("--update-golden", "--golden-dir", str(folder)) == 0
    return folder


def sharded_check(golden: Path, variant: str, monkeypatch, out: Path) -> int:
    monkeypatch.setenv("SHARDED_LM", variant)
    return train_cli("--check", "--nproc", "2", "--golden-dir", str(golden),
                     "--json", str(out))


def assert_within(out: Path) -> None:
    data = json.loads(out.read_text())
    verdict = data["comparison"]
    assert data["ranks"] == 2
    assert verdict["verdict"] == "within" and verdict["first_divergence"] is None
    judged = {(p["quantity"], p["step"]) for p in verdict["points"]}
    quantities = ("loss", "grad_norm", "update_norm", "grad_norm[decay]",
                  "update_norm[no_decay]")
    assert judged >= {(q, n) for q in quantities for n in range(1, int(STEPS) + 1)}


def test_fsdp2_data_parallel_training_is_within_the_one_process_band(golden, monkeypatch,
                                                                    tmp_path, capsys):
    out = tmp_path / "verdict.json"
    assert sharded_check(golden, "fsdp", monkeypatch, out) == 0
    assert_within(out)
    printed = capsys.readouterr().out
    assert "sharded over 2 ranks" in printed and "within" in printed


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["tp", "manual_tp"])
def test_tensor_parallel_training_is_within_the_one_process_band(golden, monkeypatch,
                                                                  tmp_path, variant):
    out = tmp_path / "verdict.json"
    assert sharded_check(golden, variant, monkeypatch, out) == 0
    assert_within(out)


@pytest.mark.slow
def test_input_gradients_never_summed_over_the_ranks_part_at_step_1(golden, monkeypatch,
                                                                    tmp_path, capsys):
    out = tmp_path / "verdict.json"
    assert sharded_check(golden, "unreduced_input_grads", monkeypatch, out) == 1
    verdict = json.loads(out.read_text())["comparison"]
    first = verdict["first_divergence"]
    assert first["step"] == 1 and first["quantity"].startswith("grad_norm")
    assert point(verdict, "loss", 1)["headroom"] <= 1.0  # the forward is one process's
    assert "the runs part at step 1" in capsys.readouterr().out


@pytest.mark.slow
def test_torch_clipping_of_hand_made_slices_parts_after_the_first_update(golden, monkeypatch,
                                                                        tmp_path):
    """``clip_grad_norm_`` clips each rank by its slices' norm: the gradients before clipping
    and Adam's first update (the gradient's sign, whatever its scale) are one process's; the
    second update, whose moments mix two scales, is not."""
    out = tmp_path / "verdict.json"
    assert sharded_check(golden, "local_clip", monkeypatch, out) == 1
    verdict = json.loads(out.read_text())["comparison"]
    assert verdict["first_divergence"]["step"] > 1
    assert all(p["headroom"] <= 1.0 for p in verdict["points"] if p["step"] == 1)


def point(verdict: dict, quantity: str, step: int) -> dict:
    return next(p for p in verdict["points"] if (p["quantity"], p["step"]) == (quantity, step))


@pytest.mark.parametrize(("variant", "status", "said"), [
    ("rank_one_dies", 2, "rank 1 died (Signal 9"),
    # its heartbeat goes silent: rank 0 ends the run in 10 s, not the collective timeout's 300
    pytest.param("rank_one_stops", 2, "(stopped, or frozen) at step 3; every rank was stopped",
                 marks=pytest.mark.slow),
    pytest.param("rank_one_raises", 3, "raised FloatingPointError: planted failure in step 3 "
                 "of rank 1", marks=pytest.mark.slow)])
def test_a_rank_that_fails_mid_training_ends_the_run_in_one_line(golden, monkeypatch, tmp_path,
                                                                 capsys, variant, status, said):
    before = {path: path.read_bytes() for path in golden.rglob("*") if path.is_file()}
    out = tmp_path / "verdict.json"
    assert sharded_check(golden, variant, monkeypatch, out) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert not out.exists()
    assert {path: path.read_bytes() for path in golden.rglob("*") if path.is_file()} == before


@pytest.mark.parametrize("flags", [["--update-golden"], ["--base", "HEAD", "--check"], []])
def test_a_sharded_run_only_checks_against_one_process(flags, tmp_path, capsys):
    assert train_cli(*flags, "--nproc", "2", "--golden-dir", str(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "without --nproc (--update-golden)" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_diagnose_inside_your_own_torchrun_is_refused_before_any_rank_trains(tmp_path, capsys,
                                                                             monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_cli("--check", "--diagnose", "--golden-dir", str(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--diagnose drills down a run of one process" in err[0], err
