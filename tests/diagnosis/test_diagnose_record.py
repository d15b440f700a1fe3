"""Across revisions: ``record`` in one process, ``diagnose_against`` in another, and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torchparity as tp
from torchparity.errors import TorchParityError, UsageError
from torchparity.reference import build_model, zoo

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

SRC = Path(__file__).resolve().parents[2] / "src"

FACTORY = textwrap.dedent("""
    import os
    from torchparity.reference import build_model, sequence_loss, zoo

    def make():
        cfg = zoo.get("llama-tiny").config
        model = build_model(cfg, seed=0)
        if os.environ.get("TP_PLANT") == "eps":  # the "changed revision"
            model.decoder.layers[1].mlp_norm.eps = 1e-4
        return model, zoo.make_batch(cfg, batch_size=2, seq_len=8, seed=0), sequence_loss

    def make_renamed():
        model, batch, loss = make()
        model.decoder.blocks = model.decoder.layers  # B calls its layers "blocks"
        del model.decoder.layers
        model.decoder.__class__ = type("Renamed", (type(model.decoder),), {
            "layers": property(lambda self: self.blocks)})
        return model, batch, loss
""")


def torchparity_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{cwd}", "TP_PLANT": "",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torchparity.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def factory_dir(tmp_path: Path) -> Path:
    (tmp_path / "tpfactory.py").write_text(FACTORY)
    return tmp_path


def llama() -> tuple:
    cfg = zoo.get("llama-tiny").config
    return build_model(cfg, seed=0), zoo.make_batch(cfg, batch_size=2, seq_len=8, seed=0)


def test_record_in_one_process_diagnose_in_another(factory_dir: Path, monkeypatch,
                                                   capsys) -> None:
    from torchparity.cli import main
    from torchparity.reference import sequence_loss

    recorded = torchparity_cli("record", "tpfactory:make", "-o", "base.tptrace", cwd=factory_dir)
    assert recorded.returncode == 0, recorded.stderr
    meta = json.loads((factory_dir / "base.tptrace" / "trace.json").read_text())
    assert meta["backward"] and meta["weights"] and meta["modules"][0]["type"] == "DecoderLM"

    # The changed revision, in this process, through the CLI.
    monkeypatch.chdir(factory_dir)
    monkeypatch.syspath_prepend(str(factory_dir))
    monkeypatch.setenv("TP_PLANT", "eps")
    code = main(["diagnose", "tpfactory:make", "--against", "base.tptrace",
                 "--json", "report.json", "--html", "report.html"])
    assert code == 1
    report = json.loads((factory_dir / "report.json").read_text())
    assert report["first_divergence"]["module"] == "decoder.layers.1.mlp_norm"
    assert report["first_grad_divergence"]["module"] == "decoder.layers.1.mlp_norm"
    assert "decoder.layers.1.mlp_norm" in capsys.readouterr().out
    assert (factory_dir / "report.html").read_text().startswith("<!DOCTYPE html>")

    # The unchanged model agrees with the trace everywhere.
    model, batch = llama()
    same = tp.diagnose_against(factory_dir / "base.tptrace", model, batch, loss_fn=sequence_loss,
                               local="all")
    assert same.first_divergence is None and same.first_grad_divergence is None
    assert all(r.local.verdict == "identical" for r in same.rows)
    assert same.meta.weights["changed"] == []


def test_changed_weights_are_reported(tmp_path: Path) -> None:
    model, batch = llama()
    path = tp.record(model, batch, tmp_path / "t.tptrace", backward=False)
    other = build_model(zoo.get("llama-tiny").config, seed=1)
    report = tp.diagnose_against(path, other, batch)
    assert "decoder.layers.0.attn.q_proj.weight" in report.meta.weights["changed"]
    assert any("differ from the recorded ones" in n for n in report.meta.notes)


def test_trace_errors_say_what_to_do(tmp_path: Path) -> None:
    model, batch = llama()
    with pytest.raises(TorchParityError, match="torchparity record"):
        tp.diagnose_against(tmp_path / "missing.tptrace", model, batch)
    path = tp.record(model, batch, tmp_path / "t.tptrace", backward=False)
    other_batch = zoo.make_batch(model.config, batch_size=2, seq_len=8, seed=1)
    with pytest.raises(UsageError, match="inputs differ from the ones recorded"):
        tp.diagnose_against(path, model, other_batch)
    with pytest.raises(UsageError, match="has no gradients"):
        tp.diagnose_against(path, model, batch, backward=True)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "x").write_text("")
    with pytest.raises(UsageError, match="not a torchparity trace"):
        tp.record(model, batch, tmp_path / "plain")
    assert (tmp_path / "plain" / "x").exists()


def test_recording_again_replaces_the_trace(tmp_path: Path) -> None:
    model, batch = llama()
    path = tp.record(model, batch, tmp_path / "t.tptrace", backward=False,
                     include="decoder.layers.0.*")
    tp.record(model, batch, path, backward=False, include="lm_head")
    meta = json.loads((path / "trace.json").read_text())
    assert [c["name"] for c in meta["calls"]] == ["lm_head"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.tptrace"]  # no temp dirs left


def test_cli_usage_errors_are_one_line(factory_dir: Path, monkeypatch, capsys) -> None:
    from torchparity.cli import main

    monkeypatch.chdir(factory_dir)
    monkeypatch.syspath_prepend(str(factory_dir))
    assert main(["diagnose", "tpfactory:nothing", "--against", "x"]) == 2
    assert main(["diagnose", "tpfactory:make"]) == 2
    assert main(["record", "no_such_module:make", "-o", "t"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3
    assert "has no callable 'nothing'" in lines[0]
    assert "give two entry points (A and B), or one with --against TRACE" in lines[1]
    assert "cannot import no_such_module" in lines[2]


def test_cli_diagnoses_two_entry_points_with_a_name_map(factory_dir: Path, monkeypatch) -> None:
    from torchparity.cli import main

    monkeypatch.chdir(factory_dir)
    monkeypatch.syspath_prepend(str(factory_dir))
    code = main(["diagnose", "tpfactory:make", "tpfactory:make_renamed", "--no-backward",
                 "--name-map", r"decoder\.layers\.(.*)=decoder.blocks.\1", "--json", "r.json"])
    assert code == 0
    report = json.loads((factory_dir / "r.json").read_text())
    assert report["first_divergence"] is None and not report["unmatched_a"]
    assert {r["how"] for r in report["rows"] if r["module"].startswith("decoder.blocks")} == {
        "name_map"}
