"""Factories import as scripts do: a file's folder comes first on ``sys.path``, so a factory
that imports a module beside it works from any working directory, in every command and in
Python."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from torchparity.cli import main
from torchparity.subject import Subject

HELPER = '''
import torch


def build():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3), (torch.randn(2, 4, generator=torch.Generator().manual_seed(1)),)
'''

FACTORY = '''
from {helper} import build


def make():
    return build()
'''


@pytest.fixture
def factory_file(tmp_path: Path, request: pytest.FixtureRequest, monkeypatch) -> Path:
    """models.py importing a helper module beside it, in a folder that is not the working
    directory (each test's helper has its own name: imported modules stay imported)."""
    helper = f"my_helpers_{request.node.name.replace('[', '_').replace(']', '')}"
    folder = tmp_path / "project" / "tests"
    folder.mkdir(parents=True)
    (folder / f"{helper}.py").write_text(HELPER)
    (folder / "models.py").write_text(FACTORY.format(helper=helper))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", list(sys.path))  # what the import adds goes afterwards
    return folder / "models.py"


def test_a_factory_imports_the_module_beside_it_from_another_folder(factory_file) -> None:
    subject = Subject.load(f"{factory_file}:make")
    assert subject.model.out_features == 3 and subject.inputs[0].shape == (2, 4)
    assert sys.path[0] == str(factory_file.parent.resolve())


def test_the_commands_load_such_a_factory(factory_file, capsys) -> None:
    entry, goldens = f"{factory_file}:make", str(factory_file.parent / "golden")
    assert main(["golden", "update", "--model", entry, "--golden-dir", goldens]) == 0
    assert main(["check", "--model", entry, "--golden-dir", goldens, "--backend", "manual",
                 "--dtype", "fp32"]) == 0
    assert "OK" in capsys.readouterr().out
