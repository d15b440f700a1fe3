"""Tests of ``torchparity check``: it passes on the code as it is, fails naming the case and the
output when one reference component changes, reports unavailable cells as n/a with the reason,
writes the documented JSON, and rejects bad arguments with exit status 2."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from torchparity import backends
from torchparity.cli import main
from torchparity.golden.cases import OUTPUT_KINDS
from torchparity.golden.cell_selection import select_cells
from torchparity.reference import models, norms, positions, zoo
from torchparity.train import trainer

SHIPPED = Path(__file__).resolve().parents[2] / "golden"
VERDICTS = {"identical", "within", "diverged", "n/a", "init changed", "inputs changed"}


def check(tmp_path: Path, *args: str) -> tuple[int, dict]:
    """Run the command in this process (so monkeypatches apply) and return (status, JSON).

    A later ``--golden-dir`` in ``args`` overrides the shipped goldens."""
    report = tmp_path / "check.json"
    status = main(["check", "--jobs", "1", "--golden-dir", str(SHIPPED), "--json", str(report),
                   *args])
    return status, json.loads(report.read_text())


def failures(report: dict) -> list[tuple[str, str, str, str]]:
    return [(r["case"], r["backend"], r["dtype"], r["output"])
            for r in report["results"] if not r["ok"]]


@pytest.mark.rounding
def test_check_passes_on_the_code_as_it_is(tmp_path, capsys):
    status, report = check(tmp_path, "--case", "llama-tiny", "--case", "encdec-relative",
                           "--backend", "manual", "--backend", "sdpa")
    assert status == 0 and report["ok"]
    cells = {(r["case"], r["backend"], r["dtype"]) for r in report["results"]}
    assert cells == {(case, backend, dtype) for case in ("llama-tiny", "encdec-relative")
                     for backend, dtype in [("manual", "fp64"), ("manual", "fp32"),
                                            ("sdpa", "fp32"), ("manual", "bf16"),
                                            ("sdpa", "bf16")]}
    out = capsys.readouterr().out
    assert "llama-tiny" in out and "OK:" in out


def test_padded_zoo_cases_pass_and_say_what_they_left_out(tmp_path, capsys):
    cases = {"llama-tiny": "left", "encdec-prenorm": "right", "nope-postnorm": "none"}
    args = [arg for case in cases for arg in ("--case", case)]
    status, report = check(tmp_path, *args, "--backend", "sdpa", "--dtype", "fp32")
    assert status == 0 and report["ok"]
    out = capsys.readouterr().out
    for case, padding in cases.items():
        mask = zoo.padding_mask(2, 12, padding)
        rows = {(r["backend"], r["output"]): r["left_out"] for r in report["results"]
                if r["case"] == case}
        if mask is None:
            assert set(rows.values()) == {None}
            continue
        counted = f"{int((mask == 0).sum())} of {mask.numel()} positions"
        for cell in ("manual", "sdpa"):
            assert counted in rows[cell, "logits"] and counted in rows[cell, "hidden"]
            # The loss ignores padded targets itself; gradients and decoding have no positions.
            assert rows[cell, "loss"] is rows[cell, "grads"] is rows[cell, "decode"] is None
        # One line per output and reason names every case it holds for (wrapped at 80).
        assert re.search(rf"\b{case}(, [\w-]+)* logits: {counted}", " ".join(out.split()))


def test_a_key_mask_forgotten_under_right_padding_shows_where_it_reaches_real_queries(
        tmp_path, monkeypatch):
    # Causal attention on a right-padded batch: padded keys come after every real query, so a
    # forgotten key mask changes only padded positions of the forward, which are not judged;
    # the tokens decoded after the padding attend to them, and decoding fails.
    leak_padding_mask(monkeypatch)
    status, report = check(tmp_path, "--case", "mqa", "--backend", "manual", "--dtype", "fp32")
    assert status == 1
    assert set(failures(report)) == {("mqa", "manual", "fp64", "decode")}


def test_json_rows_follow_the_documented_schema(tmp_path):
    _, report = check(tmp_path, "--case", "alibi", "--backend", "sdpa-math")
    assert set(report) >= {"ok", "results"} and isinstance(report["ok"], bool)
    assert {r["output"] for r in report["results"]} == set(OUTPUT_KINDS)
    for row in report["results"]:
        assert {"case", "backend", "dtype", "output", "verdict", "headroom", "ok"} <= set(row)
        assert row["verdict"] in VERDICTS
        assert row["headroom"] is None or isinstance(row["headroom"], float) or (
            row["headroom"] == "inf")
        assert row["ok"] == (row["verdict"] not in {"diverged", "init changed",
                                                    "inputs changed"})


def shift_rotary_frequencies(monkeypatch):
    """Rotary frequencies shifted by one index: each pair turns at its neighbour's rate."""
    angles = positions.rotary_angles
    monkeypatch.setattr(positions, "rotary_angles", lambda *a: angles(*a).roll(1, dims=-1))


def tenfold_rmsnorm_eps(monkeypatch):
    """RMSNorm with ten times its configured eps."""
    init = norms.RMSNorm.__init__

    def patched(self, dim: int, eps: float) -> None:
        init(self, dim, eps * 10)

    monkeypatch.setattr(norms.RMSNorm, "__init__", patched)


def leak_padding_mask(monkeypatch):
    """Self-attention masks that forget the padding: padded keys stay visible (to the real
    queries after them in a left-padded batch)."""
    mask = models.self_attention_mask
    monkeypatch.setattr(models, "self_attention_mask", lambda key_mask, *a, **k: mask(None, *a,
                                                                                       **k))


@pytest.mark.rounding
@pytest.mark.parametrize("case, change", [
    ("llama-tiny", shift_rotary_frequencies),
    ("llama-tiny", tenfold_rmsnorm_eps),
    ("llama-tiny", leak_padding_mask),
])
def test_a_changed_component_fails_naming_case_and_output(tmp_path, capsys, monkeypatch, case,
                                                           change):
    golden_dir = tmp_path / "golden"
    shutil.copytree(SHIPPED / case, golden_dir / case)
    change(monkeypatch)
    status, report = check(tmp_path, "--case", case, "--backend", "manual",
                           "--golden-dir", str(golden_dir))
    assert status == 1 and not report["ok"]
    assert (case, "manual", "fp64", "logits") in failures(report)
    out = capsys.readouterr().out
    # The reference cell is called so everywhere, and its failure, a change of the model's
    # own math, is said first, before the table.
    assert f"FAIL {case} reference fp64 cpu logits: diverged" in out
    assert " ".join(out.split()).startswith(
        f"The model's outputs changed: {case}'s reference fp64 cpu cell")
    assert "manual fp64" not in out
    # The reference cell leaves the float64 values it obtained beside the golden.
    assert (golden_dir / case / "logits.obtained.safetensors").exists()


def test_a_backend_that_leaks_the_mask_fails_only_in_its_cells(tmp_path, monkeypatch):
    # The bias path of the sdpa backends drops the boolean mask: ALiBi cases see the future.
    monkeypatch.setattr(backends, "_sdpa_mask", lambda mask, bias, dtype: (
        mask if bias is None else bias.to(dtype)))
    status, report = check(tmp_path, "--case", "alibi", "--backend", "manual",
                           "--backend", "sdpa-math")
    assert status == 1
    failed = failures(report)
    assert ("alibi", "sdpa-math", "fp32", "logits") in failed
    assert {backend for _, backend, _, _ in failed} == {"sdpa-math"}


def test_changed_init_is_reported_as_such_not_as_divergence(tmp_path, capsys):
    shutil.copytree(SHIPPED / "mqa", tmp_path / "golden" / "mqa")
    for output in OUTPUT_KINDS:
        path = tmp_path / "golden" / "mqa" / f"{output}.json"
        summary = json.loads(path.read_text())
        summary["checksums"]["weights"] = "sha256:" + "0" * 64
        path.write_text(json.dumps(summary))
    report_path = tmp_path / "report.json"
    status = main(["check", "--case", "mqa", "--backend", "manual", "--jobs", "1",
                   "--golden-dir", str(tmp_path / "golden"), "--json", str(report_path)])
    assert status == 1
    verdicts = {r["verdict"] for r in json.loads(report_path.read_text())["results"]}
    assert verdicts == {"init changed"}
    assert "torchparity golden update mqa" in capsys.readouterr().out


def test_cells_that_cannot_run_are_na_with_their_reason(tmp_path, capsys):
    status, report = check(tmp_path, "--case", "encdec-relative", "--backend", "sdpa-flash",
                           "--backend", "sdpa-cudnn", "--dtype", "fp32")
    assert status == 0
    rows = {(r["backend"], r["output"]): r for r in report["results"] if r["dtype"] == "fp32"}
    # A trainable relative-position bias has no flash backward; its forward still runs.
    assert rows["sdpa-flash", "grads"]["verdict"] == "n/a"
    assert "trainable additive bias" in rows["sdpa-flash", "grads"]["reason"]
    assert rows["sdpa-flash", "logits"]["verdict"] in {"identical", "within"}
    if not torch.cuda.is_available():
        assert {r["verdict"] for (b, _), r in rows.items() if b == "sdpa-cudnn"} == {"n/a"}
        assert "CUDA" in rows["sdpa-cudnn", "logits"]["reason"]
    out = capsys.readouterr().out
    assert "[1] grads n/a: sdpa-flash cannot run this call" in out


def test_worker_processes_give_the_same_verdicts(tmp_path):
    args = ["--case", "nope-postnorm", "--backend", "sdpa", "--dtype", "fp32"]
    _, in_process = check(tmp_path, *args)
    report = tmp_path / "parallel.json"
    assert main(["check", "--jobs", "2", "--golden-dir", str(SHIPPED), "--json", str(report),
                 *args]) == 0
    parallel = json.loads(report.read_text())
    assert [(r["backend"], r["dtype"], r["output"], r["verdict"], r["headroom"])
            for r in parallel["results"]] == [
        (r["backend"], r["dtype"], r["output"], r["verdict"], r["headroom"])
        for r in in_process["results"]]


@pytest.mark.parametrize("argv, message", [
    (["--case", "nope"], "unknown zoo case 'nope'"),
    (["--backend", "fast"], "unknown attention backend 'fast'"),
    (["--dtype", "fp8"], "unknown dtype 'fp8'"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--jobs", "0"], "--jobs must be at least 1"),
    (["--json", "/nonexistent/folder/report.json"],
     "its folder /nonexistent/folder does not exist; create it"),
])
def test_bad_arguments_give_one_line_and_exit_2(capsys, argv, message):
    assert main(["check", "--golden-dir", str(SHIPPED), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_usage_error(capsys):
    assert main(["check", "--golden-dir", str(SHIPPED), "--device", "cuda"]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err


@pytest.mark.rounding
def test_train_flag_checks_the_golden_trajectories(tmp_path, capsys):
    status, report = check(tmp_path, "--train", "--case", "mqa", "--backend", "manual",
                           "--dtype", "fp32")
    assert status == 0
    rows = [r for r in report["results"] if r["output"] == "trajectory"]
    assert [(r["case"], r["backend"], r["dtype"]) for r in rows] == [("mqa", "manual", "fp32")]
    # Judged against the float64 golden within the fp32 noise band stored with it.
    assert rows[0]["verdict"] == "within" and rows[0]["headroom"] <= 1
    assert "OK:" in capsys.readouterr().out


def test_train_flag_fails_when_the_training_code_changes(tmp_path, monkeypatch):
    # The summed loss divided by the number of sentences instead of target tokens.
    monkeypatch.setattr(trainer, "loss_denominator", lambda batch, normalization:
                        batch.n_sentences)
    status, report = check(tmp_path, "--train", "--case", "mqa", "--backend", "manual",
                           "--dtype", "fp32")
    assert status == 1
    assert failures(report) == [("mqa", "manual", "fp32", "trajectory")]


@pytest.mark.slow
def test_full_default_check_passes(tmp_path):
    report = tmp_path / "all.json"
    assert main(["check", "--golden-dir", str(SHIPPED), "--json", str(report)]) == 0
    rows = json.loads(report.read_text())["results"]
    assert {r["case"] for r in rows} == set(zoo.names())
    assert {r["backend"] for r in rows} == set(backends.names())
    flex_grads = [r for r in rows if r["backend"] == "flex" and r["output"] == "grads"]
    assert flex_grads and all(r["verdict"] == "n/a" and "backward" in r["reason"]
                              for r in flex_grads)


def test_a_cuda_machine_adds_cuda_cells_in_four_dtypes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cells = select_cells(["manual"], None, None)
    assert [(c.device, c.dtype) for c in cells] == [
        ("cpu", "fp64"), ("cpu", "fp32"), ("cpu", "bf16"),
        ("cuda", "fp32"), ("cuda", "tf32"), ("cuda", "bf16"), ("cuda", "fp16")]
    assert [c.dtype for c in select_cells(None, ["tf32"], None) if c.device == "cpu"] == ["fp64"]


@pytest.mark.gpu
def test_check_passes_on_the_gpu(tmp_path, device):
    status, report = check(tmp_path, "--device", device, "--case", "llama-tiny",
                           "--case", "encdec-relative")
    assert status == 0, failures(report)
    assert {r["device"] for r in report["results"]} == {"cpu", device}


@pytest.mark.parametrize("command", [["check"], ["train", "--case", "llama-tiny"], ["bench"],
                                     ["backends"], ["calibrate"]])
@pytest.mark.parametrize("written, short", [("float32", "fp32"), ("bfloat16", "bf16"),
                                            ("torch.float16", "fp16"), ("fp32", "fp32")])
def test_every_dtype_option_takes_torch_names(command, written, short):
    from torchparity.cli import build_parser

    argv = [*command, "--dtype", written]
    args = build_parser(argv).parse_args(argv)
    assert args.dtype in (short, [short])


def test_check_runs_with_a_torch_dtype_name(tmp_path):
    status, report = check(tmp_path, "--case", "mqa", "--backend", "sdpa", "--dtype", "float32")
    assert status == 0
    assert {r["dtype"] for r in report["results"]} == {"fp64", "fp32"}
