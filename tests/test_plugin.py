"""The pytest plugin in other people's suites: a throw-away project run by a real pytest, with
torchparity's plugin and without it (``-p no:torchparity``), must give the same outcomes; a suite
that opts in gets the ``gpu`` marker, read as a marker only."""

from __future__ import annotations

import os
import re
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import toy_repo
from torchparity.cli import main

SRC = Path(__file__).resolve().parents[1] / "src"
INSTALLED = any(ep.name == "torchparity" for ep in entry_points(group="pytest11"))
# How to run a pytest with and without the plugin, installed or from the source tree.
WITH_PLUGIN = () if INSTALLED else ("-p", "torchparity.pytest_plugin")
WITHOUT_PLUGIN = ("-p", "no:torchparity") if INSTALLED else ()

# A project of its own: a --device option, a device fixture, a gpu marker of its own meaning
# and a test parametrized over "cpu" and "gpu", none of which torchparity may touch.
USER_CONFTEST = '''
import pytest


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", help="the project's own option")


@pytest.fixture
def device(request):
    return "project:" + request.config.getoption("--device")
'''

USER_TESTS = '''
import sys

import pytest


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_target(target, device):
    assert device == "project:tpu7"


@pytest.mark.gpu
def test_marked_with_the_projects_own_gpu_marker(device):
    assert device == "project:tpu7"


def test_gpu():
    pass


def test_torch_is_not_imported():
    assert "torch" not in sys.modules
'''

USER_INI = '''[pytest]
addopts = --strict-markers
markers =
    gpu: the project's own meaning
'''


def outcomes(result: pytest.RunResult) -> dict[str, str]:
    """``{test id: PASSED/FAILED/SKIPPED/ERROR}`` from a ``-v`` run."""
    found = re.findall(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)",
                       result.stdout.str(), re.MULTILINE)
    return dict(found)


@pytest.fixture
def run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    """A real pytest in a fresh process, as a user runs it (plugins from entry points)."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))

    def run(*args: str) -> pytest.RunResult:
        # Without hypothesis's plugin, which is not under test and takes seconds to import.
        return pytester.runpytest_subprocess(
            "-v", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", *args)

    return run


def test_a_project_runs_as_it_would_without_torchparity(pytester, run):
    pytester.makeconftest(USER_CONFTEST)
    pytester.makepyfile(test_user=USER_TESTS)
    pytester.makeini(USER_INI)

    without = run(*WITHOUT_PLUGIN, "--device", "tpu7")
    with_plugin = run(*WITH_PLUGIN, "--device", "tpu7")

    expected = {f"test_user.py::{name}": "PASSED" for name in (
        "test_target[cpu]", "test_target[gpu]", "test_marked_with_the_projects_own_gpu_marker",
        "test_gpu", "test_torch_is_not_imported")}
    assert outcomes(without) == expected, without.stdout.str()
    assert outcomes(with_plugin) == expected, with_plugin.stdout.str()
    assert with_plugin.ret == without.ret == 0
    # The plugin was really there: its options are listed under their own names.
    assert "--torchparity-device" in run(*WITH_PLUGIN, "--help").stdout.str()


OPTED_IN_TESTS = '''
import pytest


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_target(target, torchparity_device):
    assert torchparity_device == "cpu"


@pytest.mark.gpu
def test_on_the_gpu(torchparity_device):
    assert torchparity_device == "cpu"


def test_gpu(torchparity_device):
    assert torchparity_device == "cpu"
'''


def test_a_suite_that_opts_in_gets_the_gpu_marker(pytester, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pytester.makepyfile(test_opted=OPTED_IN_TESTS)
    pytester.makeini("[pytest]\naddopts = --strict-markers\ntorchparity_gpu_marker = true\n")

    on_cuda = pytester.runpytest_inprocess("-v", "-rs", "-p", "no:cacheprovider", *WITH_PLUGIN)
    assert outcomes(on_cuda) == {
        "test_opted.py::test_target[cpu]": "PASSED",
        "test_opted.py::test_target[gpu]": "PASSED",
        "test_opted.py::test_on_the_gpu": "SKIPPED",
        "test_opted.py::test_gpu": "PASSED",
    }, on_cuda.stdout.str()
    on_cuda.stdout.fnmatch_lines(["*no CUDA device here; '--torchparity-device cpu' runs*"])

    on_cpu = pytester.runpytest_inprocess("-p", "no:cacheprovider", *WITH_PLUGIN,
                                          "--torchparity-device", "cpu")
    on_cpu.assert_outcomes(passed=4)


def test_the_gpu_marker_is_not_registered_unless_asked_for(pytester, run):
    pytester.makepyfile(test_marked="import pytest\n\n@pytest.mark.gpu\ndef test_x():\n"
                                    "    pass\n")
    pytester.makeini("[pytest]\naddopts = --strict-markers\n")
    result = run(*WITH_PLUGIN)  # a fresh process: markers seen by this one are remembered
    result.stdout.fnmatch_lines(["*'gpu' not found in `markers` configuration option*"])
    assert result.ret == pytest.ExitCode.INTERRUPTED


SUMMARY_TESTS = '''
import pytest

from torchparity.pytest_plugin import add_summary_line


@pytest.mark.parametrize("i", [1, 2])
def test_measures(request, i):
    add_summary_line(request.node, "throughput", f"run {i}: {100 * i} tokens/s")


def test_fails_after_measuring(request):
    add_summary_line(request.node, "throughput", "run 3: 300 tokens/s")
    assert False
'''


def test_summary_lines_reach_the_terminal_summary(pytester):
    pytester.makepyfile(test_summary=SUMMARY_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", *WITH_PLUGIN)
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*= throughput =*", "run 1: 100 tokens/s",
                                 "run 2: 200 tokens/s", "run 3: 300 tokens/s"])


MODEL_PARITY_TESTS = '''
import pytest
import torchparity as tp


@pytest.mark.parametrize("cell", tp.model_cells(backends=["sdpa"], dtypes=["fp32"]), ids=str)
def test_my_model(model_parity, cell):
    model_parity("tests/my_models.py:make", cell)
'''


def test_model_parity_finds_its_entry_from_any_folder_and_says_a_missing_golden_once(
        pytester, monkeypatch):
    """The entry ``tests/my_models.py:make`` is found under the rootdir when pytest runs in
    ``tests/``; a missing golden is said once, with the command that makes it there."""
    tests = pytester.mkdir("tests")
    (tests / "my_models.py").write_text(toy_repo.MODELS)
    (tests / "test_m.py").write_text(MODEL_PARITY_TESTS)
    pytester.makeini("[pytest]\n")
    monkeypatch.chdir(tests)
    # -rN: pytest's own one-line recap repeats the message whole where it runs in CI
    # (CI=true turns off its truncation); the count below is of the failure's report alone.
    missing = pytester.runpytest_inprocess("-rN", "-p", "no:cacheprovider", *WITH_PLUGIN,
                                           "test_m.py", "-k", "sdpa")
    missing.assert_outcomes(failed=1)
    text = missing.stdout.str()
    assert "Traceback" not in text and "During handling" not in text
    # Run from tests/, whose golden/ is where the command writes by default.
    command = f"`torchparity golden update --model {tests / 'my_models.py'}:make`"
    assert text.count(command) == 1, text  # in the failure, not again as its cause

    assert main(["golden", "update", "--model", str(tests / "my_models.py:make"),
                 "--golden-dir", str(tests / "golden")]) == 0
    passed = pytester.runpytest_inprocess("-p", "no:cacheprovider", *WITH_PLUGIN, "test_m.py")
    passed.assert_outcomes(passed=2)


def test_tests_skipped_for_want_of_cuda_are_counted_on_one_line(pytester, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pytester.makepyfile(test_many="import pytest\n\n" + "".join(
        f"@pytest.mark.gpu\ndef test_{i}(torchparity_device):\n    pass\n\n" for i in range(4)))
    pytester.makeini("[pytest]\ntorchparity_gpu_marker = true\n")
    result = pytester.runpytest_inprocess("-rs", "-p", "no:cacheprovider", *WITH_PLUGIN)
    result.assert_outcomes(skipped=4)
    reasons = [line for line in result.stdout.lines if line.startswith("SKIPPED")]
    assert len(reasons) == 1 and reasons[0].startswith("SKIPPED [4] ") and \
        "no CUDA device here" in reasons[0], reasons
