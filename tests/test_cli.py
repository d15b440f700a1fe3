"""The command's contract with CI: exit status 2 for usage and file errors, 3 for an unexpected
error (one line naming the exception and where it was raised; ``--debug`` adds the traceback),
``--version``, and ``python -m torchparity``."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

import torchparity
from torchparity import cli
from torchparity.commands import backends as backends_command

FACTORY = '''
def make():
    raise ValueError("the factory broke\\nwith a second line")
'''


@pytest.fixture
def raising_factory(tmp_path):
    path = tmp_path / "models.py"
    path.write_text(FACTORY)
    return f"{path}:make", f"{path}:3"


def test_a_factory_that_raises_exits_3_with_one_line_naming_where(raising_factory, tmp_path,
                                                                   capsys):
    entry, where = raising_factory
    assert cli.main(["record", entry, "-o", str(tmp_path / "trace")]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "ValueError: the factory broke" in err
    assert f"(at {where})" in err
    assert "--debug shows the traceback" in err
    assert "Traceback" not in err
    assert not (tmp_path / "trace").exists()


@pytest.mark.parametrize("before", [True, False], ids=["debug-first", "debug-after"])
def test_debug_shows_the_traceback(raising_factory, tmp_path, capsys, before):
    entry, where = raising_factory
    args = ["record", entry, "-o", str(tmp_path / "trace")]
    assert cli.main(["--debug", *args] if before else [*args, "--debug"]) == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert 'raise ValueError("the factory broke' in err
    last = err.splitlines()[-1]
    assert last.startswith("torchparity record: error:") and f"(at {where})" in last


@pytest.mark.parametrize("command", [["golden", "update"], ["golden", "verify"],
                                     ["check"]], ids=" ".join)
def test_every_command_that_says_debug_shows_the_traceback_takes_debug(
        raising_factory, tmp_path, capsys, command):
    """The hint is said wherever an error comes from the user's code; the subcommands of a
    command (golden update) take the option too, wherever it stands."""
    entry, _ = raising_factory
    args = [*command, "--model", entry, "--golden-dir", str(tmp_path / "goldens")]
    assert cli.main(args) == 3
    assert capsys.readouterr().err.endswith("; --debug shows the traceback\n")
    assert cli.main([*args, "--debug"]) == 3
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_an_unexpected_error_exits_3_naming_the_exception_and_frame(monkeypatch, capsys):
    def broken(args):
        return {}["no such key"]

    monkeypatch.setattr(backends_command, "run", broken)
    assert cli.main(["backends"]) == 3
    err = capsys.readouterr().err
    line = broken.__code__.co_firstlineno + 1
    assert err == (f"torchparity backends: unexpected KeyError: 'no such key' "
                   f"(at {__file__}:{line}); --debug shows the traceback\n")


def _raise_in_a_worker() -> None:
    raise ZeroDivisionError("in the worker")


def test_an_unexpected_error_in_a_worker_process_names_the_worker_frame(monkeypatch, capsys):
    def run_in_a_worker(args):
        context = multiprocessing.get_context("fork")  # the test module is already imported
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            return pool.submit(_raise_in_a_worker).result()

    monkeypatch.setattr(backends_command, "run", run_in_a_worker)
    assert cli.main(["backends"]) == 3
    line = _raise_in_a_worker.__code__.co_firstlineno + 1
    assert capsys.readouterr().err == (
        f"torchparity backends: unexpected ZeroDivisionError: in the worker "
        f"(at {__file__}:{line}); --debug shows the traceback\n")


def test_a_file_error_exits_2_in_one_line(monkeypatch, capsys):
    def unreadable(args):
        raise PermissionError(13, "Permission denied", "/goldens/llama-tiny/logits.json")

    monkeypatch.setattr(backends_command, "run", unreadable)
    assert cli.main(["backends"]) == 2
    assert capsys.readouterr().err == (
        "torchparity backends: error: [Errno 13] Permission denied: "
        "'/goldens/llama-tiny/logits.json'\n")


SHAPE_ERROR = '''
import torch
from torch import nn


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.extra = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return torch.matmul(self.proj(x), self.extra)


def make():
    return {"model": Broken(), "inputs": torch.randn(2, 8)}
'''


def test_an_error_inside_the_users_model_points_at_the_users_line(tmp_path, capsys):
    """torch raises the shape error from its own Python frames (torch/_ops.py under the
    golden run's modes): the line named is the user's call."""
    path = tmp_path / "broken.py"
    path.write_text(SHAPE_ERROR)
    line = SHAPE_ERROR.splitlines().index("        return torch.matmul(self.proj(x), "
                                          "self.extra)") + 1
    status = cli.main(["golden", "update", "--model", f"{path}:make", "--golden-dir",
                       str(tmp_path / "golden")])
    err = capsys.readouterr().err
    assert status == 3 and err.count("\n") == 1, err
    assert f"(at {path}:{line})" in err


def test_a_usage_error_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["diagnose", "a.py:make", "b.py:make", "--dtype", "fp8"])
    err = capsys.readouterr().err
    assert exit.value.code == 2
    assert err.count("\n") == 1 and err.startswith("torchparity diagnose: error: ")
    assert "'fp8'" in err and "bf16" in err and "torchparity diagnose --help" in err


def test_train_with_only_a_model_is_refused_not_ignored(capsys):
    # --train trains the zoo's golden recipes, which a user's model has not
    models = Path(__file__).parent / "sharded_models.py"
    assert cli.main(["check", "--model", f"{models}:mine_tp", "--train"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--train trains the zoo's cases by their golden recipes" in err


def test_python_m_torchparity_prints_the_version():
    result = subprocess.run([sys.executable, "-m", "torchparity", "--version"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"torchparity {torchparity.__version__}\n"
