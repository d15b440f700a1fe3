"""Tests of the ``golden`` pytest fixture in a throw-away project run by a real pytest: update
under two xdist workers loses nothing, unchanged values pass, a mismatch fails and leaves the
obtained values, a missing golden fails with the command that creates it."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

from torchparity.golden.store import GoldenStore

SRC = Path(__file__).resolve().parents[2] / "src"
N_PARAMETRIZED = 24

TEST_MODULE = f'''
import os

import pytest
import torch


def values():
    shift = float(os.environ.get("SHIFT", "0"))
    x = torch.linspace(-1, 1, 16, dtype=torch.float32)
    return {{"y": torch.tanh(x) + shift, "ids": torch.arange(4)}}


def test_forward(golden):
    golden.check("forward", values())


def test_grad(golden):
    golden.check("grad", torch.linspace(0, 1, 8, dtype=torch.float64), kind="grad")


@pytest.mark.parametrize("i", range({N_PARAMETRIZED}))
def test_many(golden, i):
    golden.check(f"many-{{i}}", {{"x": torch.full((3,), float(i))}})
'''


def run_pytest(project: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    plugin = [] if any(ep.name == "torchparity" for ep in entry_points(group="pytest11")) else [
        "-p", "torchparity.pytest_plugin"]
    environ = {**os.environ, **env,
               "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
         *plugin, *args],
        cwd=project, env=environ, capture_output=True, text=True, timeout=600)


def test_golden_fixture_lifecycle(tmp_path):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_model.py").write_text(TEST_MODULE)
    folder = tests / "golden" / "test_model"

    # Two xdist workers write goldens into one folder at once: every file arrives intact.
    update = run_pytest(tmp_path, "-n", "2", "--golden-update", "tests")
    assert update.returncode == 0, update.stdout + update.stderr
    store = GoldenStore(tests / "golden")
    names = ["forward", "grad", *(f"many-{i}" for i in range(N_PARAMETRIZED))]
    assert store.outputs("test_model") == sorted(names)
    for name in names:
        store.read("test_model", name)  # validates tensors against the JSON summary
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    assert "torchparity goldens written" in update.stdout
    for name in names:
        assert str(folder / f"{name}.safetensors") in update.stdout

    (folder / "grad.json").unlink()
    (folder / "grad.safetensors").unlink()
    golden_bytes = (folder / "forward.safetensors").read_bytes()
    changed = run_pytest(tmp_path, "tests", SHIFT="1e-3")
    assert changed.returncode == 1
    out = changed.stdout
    assert "golden 'forward': diverged" in out
    assert (folder / "forward.obtained.safetensors").exists()
    assert (folder / "forward.safetensors").read_bytes() == golden_bytes
    assert "pytest tests/test_model.py::test_forward --golden-update" in out
    assert "create it with `pytest tests/test_model.py::test_grad --golden-update`" in out
    # The goldens the change does not touch still pass against what the workers wrote.
    assert f"2 failed, {N_PARAMETRIZED} passed" in out
