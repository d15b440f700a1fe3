"""What a diagnosis could not do is said first: no float64 golden (and the fix), and an
autograd error under backward names ``--no-backward``."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

import torchparity as tp
from torchparity.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

FACTORIES = textwrap.dedent('''
    import threading
    import torch
    from torch import nn


    class Locked(nn.Module):
        """A model holding a lock: deepcopy refuses it."""

        def __init__(self):
            super().__init__()
            self.lock = threading.Lock()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            with self.lock:
                return self.proj(x)


    class InPlace(nn.Module):
        """Writes into a tensor autograd still needs (a cache updated in place)."""

        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            h = self.proj(x).sigmoid()
            h[:, 0] = 0.0
            return h


    def x():
        return torch.randn(2, 4, generator=torch.Generator().manual_seed(0))


    def seeded():
        torch.manual_seed(0)
        return Locked().eval(), (x(),)


    def unseeded():
        return Locked().eval(), (x(),)


    def in_place():
        torch.manual_seed(0)
        return InPlace().eval(), (x(),)
''')


@pytest.fixture
def factories(tmp_path: Path, monkeypatch) -> str:
    (tmp_path / "loud_models.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    return str(tmp_path / "loud_models.py")


def test_a_model_that_cannot_be_deep_copied_gets_its_golden_from_its_factory(
        factories: str, capsys) -> None:
    assert main(["record", f"{factories}:seeded", "-o", "t.tptrace"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("recorded Locked")  # no warning: the golden was made
    golden = json.loads(Path("t.tptrace/trace.json").read_text())["golden"]
    assert golden.startswith("float64 copy of A on the CPU, built again by its factory")
    assert "deepcopy" in golden or "pickle" in golden


def test_without_a_golden_every_command_says_so_first_with_the_fix(factories: str,
                                                                     capsys) -> None:
    assert main(["record", f"{factories}:unseeded", "-o", "t.tptrace"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("warning: no float64 golden: copying A to float64 failed")
    assert "the factory built other weights when called again" in first
    assert "fix: seed the factory's initialisation" in first
    assert main(["diagnose", f"{factories}:unseeded", f"{factories}:seeded"]) == 1  # weights
    assert capsys.readouterr().out.startswith("warning: no float64 golden: copying A")
    assert main(["diagnose", f"{factories}:seeded", f"{factories}:seeded"]) == 0
    assert not capsys.readouterr().out.startswith("warning")  # built again from the factory


def test_python_without_a_factory_names_the_fix(factories: str) -> None:
    from torchparity.subject import Subject

    subject = Subject.load(f"{factories}:seeded")
    report = tp.diagnose(subject.model, subject.model, subject.inputs)
    assert report.meta["golden"].startswith("none: copying A to float64 failed")
    assert "fix: make the model deep-copyable" in report.meta["golden"]
    assert report.meta["notes"][0].startswith("golden: none")


def test_an_autograd_error_under_backward_names_no_backward(factories: str, capsys) -> None:
    assert main(["diagnose", f"{factories}:in_place", f"{factories}:in_place"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run with --no-backward" in err[0], err
    assert main(["diagnose", f"{factories}:in_place", f"{factories}:in_place",
                 "--no-backward"]) == 0
