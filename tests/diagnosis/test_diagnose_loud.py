"""A model that cannot be deep-copied still gets its float64 golden (no copy is made), and an
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


def test_a_model_that_cannot_be_deep_copied_gets_its_golden_without_a_copy(
        factories: str, capsys) -> None:
    assert main(["record", f"{factories}:unseeded", "-o", "t.tptrace"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("recorded Locked")  # no warning: the golden was made
    golden = json.loads(Path("t.tptrace/trace.json").read_text())["golden"]
    assert golden.startswith("float64 run of A on the CPU (module by module, no float64 copy)")


def test_python_gets_the_golden_of_a_model_that_cannot_be_deep_copied(factories: str) -> None:
    from torchparity.subject import Subject

    subject = Subject.load(f"{factories}:seeded")
    report = tp.diagnose(subject.model, subject.model, subject.inputs)
    assert report.meta.golden.startswith("float64 run of A on the CPU")
    assert report.first_divergence is None


def test_an_autograd_error_under_backward_names_no_backward(factories: str, capsys) -> None:
    assert main(["diagnose", f"{factories}:in_place", f"{factories}:in_place"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run with --no-backward" in err[0], err
    assert main(["diagnose", f"{factories}:in_place", f"{factories}:in_place",
                 "--no-backward"]) == 0
