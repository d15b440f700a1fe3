"""Goldens made on another machine: made under another instruction set in a subprocess
(``ATEN_CPU_CAPABILITY``), a zoo case's goldens and a user model's goldens, its decoding
included, check clean here; the report names both machines, and a planted change still fails
with that as context."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchparity import machine
from torchparity.cli import main

pytest.importorskip("transformers")

HERE = torch.backends.cpu.get_cpu_capability().lower()

FACTORY = '''
import torch
import transformers

import torchparity as tp


def tiny_llama():
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_theta={rope_theta})
    input_ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0
    model = tp.init_weights(transformers.LlamaForCausalLM(config), seed=0)
    return model, {{"input_ids": input_ids, "attention_mask": attention_mask}}
'''

MAKE_GOLDENS = """
import sys
from torchparity.cli import main
assert main(["golden", "update", "llama-tiny", "--golden-dir", sys.argv[1]]) == 0
assert main(["golden", "update", "--model", "models.py:tiny_llama"]) == 0
"""


def _other_capability() -> str:
    others = [c for c in machine.capabilities() if c != HERE]
    if not others:
        pytest.skip("this CPU dispatches one instruction set only")
    return others[0]


@pytest.fixture(scope="module")
def made_elsewhere(tmp_path_factory) -> tuple[Path, str]:
    """A folder with the factory, its goldens (golden/) and llama-tiny's (zoo/), all made
    under another instruction set; and that instruction set."""
    other = _other_capability()
    folder = tmp_path_factory.mktemp("made-elsewhere")
    (folder / "models.py").write_text(FACTORY.format(rope_theta=10000.0))
    subprocess.run([sys.executable, "-c", MAKE_GOLDENS, str(folder / "zoo")], cwd=folder,
                   env=machine.environment(other), check=True, capture_output=True)
    return folder, other


def _check(folder: Path, *argv: str) -> tuple[int, dict]:
    report = folder / "report.json"
    status = main(["check", *argv, "--backend", "sdpa", "--dtype", "fp32",
                   "--json", str(report)])
    return status, json.loads(report.read_text())


def test_zoo_goldens_made_elsewhere_check_clean(made_elsewhere, capsys):
    folder, other = made_elsewhere
    status, report = _check(folder, "--case", "llama-tiny", "--golden-dir", str(folder / "zoo"),
                            "--jobs", "1")
    assert status == 0
    assert (f"goldens made on cpu {other}, torch {torch.__version__.split('+')[0]}; "
            f"this run on cpu {HERE}") in capsys.readouterr().out
    made = report["machines"]["goldens"]["llama-tiny"]
    assert {p["cpu_capability"] for p in made.values()} == {other}
    assert report["machines"]["this_run"]["cpu_capability"] == HERE


def test_a_models_goldens_and_its_decoding_made_elsewhere_check_clean(made_elsewhere,
                                                                      monkeypatch):
    folder, other = made_elsewhere
    monkeypatch.chdir(folder)
    status, report = _check(folder, "--model", "models.py:tiny_llama")
    assert status == 0
    assert {"outputs", "loss", "grads", "decode"} <= {r["output"] for r in report["results"]
                                                      if r["ok"] and r["verdict"] != "n/a"}
    assert report["machines"]["goldens"]["models.tiny_llama"]["decode"]["cpu_capability"] == other


def test_a_planted_change_fails_there_naming_both_machines(made_elsewhere, monkeypatch, capsys):
    # The rotary base changed: the same weights and inputs, another model.
    folder, other = made_elsewhere
    monkeypatch.chdir(folder)
    changed = folder / "changed" / "models.py"
    changed.parent.mkdir()
    changed.write_text(FACTORY.format(rope_theta=500.0))
    status, report = _check(folder, "--model", f"{changed}:tiny_llama")
    assert status == 1
    failed = {r["output"] for r in report["results"] if not r["ok"]}
    assert {"outputs", "decode"} <= failed
    assert not {r["verdict"] for r in report["results"]} & {"init changed", "inputs changed"}
    # A line wrapped at 80 goes on in lines indented by two: each FAIL line read whole.
    lines = re.split(r"\n(?! )", capsys.readouterr().out)
    fails = [" ".join(line.split()) for line in lines if line.startswith("FAIL ")]
    assert fails and all(f"(goldens made on cpu {other}" in line
                         and f"this run on cpu {HERE}" in line for line in fails)
