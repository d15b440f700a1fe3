"""pytest plugin: ``golden``, ``twins`` and ``torchparity_device`` fixtures, an opt-in ``gpu`` mark.

Loaded into every pytest run where torchparity is installed, so it changes nothing a suite did
not ask for: options are namespaced (``--torchparity-...``), fixtures act only when requested,
torch is imported only by them, and the ``gpu`` marker acts only with the ini option
``torchparity_gpu_marker = true``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from torchparity.golden.fixture import GoldenFixture
    from torchparity.golden.model_check import ModelReport

GPU_MARKER = "gpu"
GPU_MARKER_INI = "torchparity_gpu_marker"
DEVICE_OPTION = "--torchparity-device"
UPDATE_OPTION = "--torchparity-golden-update"
_SUMMARY_KEY = "torchparity-summary"


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add torchparity's options, namespaced so they clash with no suite's own."""
    group = parser.getgroup("torchparity")
    group.addoption(
        DEVICE_OPTION, dest="torchparity_device", default=None, metavar="DEVICE",
        help=f"device of the tests marked {GPU_MARKER} (default: cuda), for suites that set "
             f"{GPU_MARKER_INI}; 'cpu' runs their logic on a machine without a GPU",
    )
    group.addoption(
        UPDATE_OPTION, dest="torchparity_golden_update", action="store_true", default=False,
        help="write the goldens that the 'golden' fixture checks instead of comparing with "
             "them; the tests that wrote one fail so the option cannot be left on",
    )
    parser.addini(
        GPU_MARKER_INI, type="bool", default=False,
        help=f"register the '{GPU_MARKER}' marker and skip the tests it marks when CUDA is "
             f"absent (unless {DEVICE_OPTION} names another device)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Register the ``gpu`` marker, only in a suite that opts in and has not registered it."""
    if config.getini(GPU_MARKER_INI) and not _marker_registered(config, GPU_MARKER):
        config.addinivalue_line(
            "markers", f"{GPU_MARKER}: runs on CUDA (or on {DEVICE_OPTION}); skipped without it")


def _marker_registered(config: pytest.Config, name: str) -> bool:
    return any(line.split(":")[0].split("(")[0].strip() == name
               for line in config.getini("markers"))


def gpu_device(config: pytest.Config) -> str:
    """The device tests marked ``gpu`` run on: ``--torchparity-device``, else ``cuda``."""
    return config.getoption("torchparity_device") or "cuda"


#: Why a test marked ``gpu`` is skipped on a machine without CUDA.
NO_CUDA = f"no CUDA device here; '{DEVICE_OPTION} cpu' runs these tests' logic on the CPU"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked ``gpu`` without CUDA, in a suite that opted in."""
    config = item.config
    if not config.getini(GPU_MARKER_INI) or not item.get_closest_marker(GPU_MARKER):
        return
    if gpu_device(config).startswith("cuda") and not _cuda_available():
        pytest.skip(NO_CUDA)  # raised here, not marked: the summary counts them on one line


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture
def torchparity_device(request: pytest.FixtureRequest) -> str:
    """The device a test runs on: ``cpu``, or the gpu device for an opted-in suite's gpu tests."""
    if request.config.getini(GPU_MARKER_INI) and request.node.get_closest_marker(GPU_MARKER):
        return gpu_device(request.config)
    return "cpu"


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Iterator[GoldenFixture]:
    """Goldens of this test beside its file: ``golden.check("name", tensors, kind="forward")``.

    With ``--torchparity-golden-update`` it writes the golden instead and the test fails at
    teardown ("golden written, rerun without --torchparity-golden-update"), so the option cannot
    be left on.
    """
    from torchparity.golden.fixture import GoldenFixture

    fixture = GoldenFixture.for_test(
        request.path, request.node.nodeid, request.config.getoption("torchparity_golden_update"),
        lambda path: add_summary_line(request.node, "torchparity goldens written", str(path)),
        update_option=UPDATE_OPTION)
    yield fixture
    if fixture.written:
        pytest.fail(f"golden written, rerun without {UPDATE_OPTION}: "
                    f"{', '.join(str(path) for path in fixture.written)}", pytrace=False)


@pytest.fixture
def twins(request: pytest.FixtureRequest) -> Callable[..., int]:
    """``twins(Old, New, inputs=..., init=...)``: a refactored module checked against the original.

    :func:`torchparity.twins.search.check_twins` with this test's id as database key, so failed
    examples are tried first next time; it returns how many examples passed. See docs/twins.md.
    """
    from torchparity.twins.search import check_twins

    return functools.partial(check_twins, database_key=request.node.nodeid)


def add_summary_line(node: pytest.Item, section: str, line: str) -> None:
    """Show ``line`` once under ``section`` of the terminal summary (on the report: xdist too)."""
    node.user_properties.append((_SUMMARY_KEY, (section, line)))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Print the lines tests added with :func:`add_summary_line`, by section."""
    sections: dict[str, list[str]] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "teardown":
                continue  # the teardown report carries every line the test added
            for key, value in report.user_properties:
                if key == _SUMMARY_KEY:
                    section, line = value
                    lines = sections.setdefault(section, [])
                    if line not in lines:
                        lines.append(line)
    for section, lines in sections.items():
        terminalreporter.section(section)
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture
def model_parity(request: pytest.FixtureRequest) -> Callable[..., ModelReport]:
    """``model_parity(factory, cell)``: a user's model checked in one cell against its goldens.

    As ``torchparity check --model`` does; the test fails with one line per output that
    diverged. Parametrize over :func:`torchparity.model_cells` for one test per cell::

        @pytest.mark.parametrize("cell", tp.model_cells(dtypes=["fp32", "bf16"]), ids=str)
        def test_my_model(model_parity, cell):
            model_parity("tests/my_models.py:tiny_gpt", cell)

    A relative file entry is looked for beside the test file, then under the rootdir; goldens are
    read from ``golden/`` beside the test file unless ``golden_dir`` is given. A cell in which
    every output is ``n/a`` is skipped with the reason (``pytest -rs``): a test never passes a
    cell that did not run.
    """
    from torchparity.golden.model_check import check_model
    from torchparity.golden.store import GoldenError

    def check(factory, cell, golden_dir=None):
        entry = _entry_for_test(factory, request)
        try:
            report = check_model(entry, cells=[cell],
                                 golden_dir=golden_dir or request.path.parent / "golden")
        except GoldenError as exc:
            failure = str(exc)
        else:
            failure = None if report.ok else report.explain()
        if failure is not None:  # failed outside the except block: the message shows once
            pytest.fail(failure, pytrace=False)
        if not_run := not_applicable(report):  # a cell that ran nothing passes nothing
            # said at the test's line, as a skip mark's reason is, not at this one
            raise pytest.skip.Exception(f"{cell}: n/a: {not_run}", _use_item_location=True)
        return report

    return check


def not_applicable(report: ModelReport) -> str | None:
    """Why no output of ``report`` was judged (each row's reason once), or None when some was."""
    if not report.results or any(row.verdict != "n/a" for row in report.results):
        return None
    return "; ".join(dict.fromkeys(row.reason or "could not run" for row in report.results))


def _entry_for_test(factory, request: pytest.FixtureRequest):
    """``file.py:name`` with its relative path found beside the test file, else in the rootdir."""
    if not isinstance(factory, str):
        return factory
    location, _, name = factory.rpartition(":")
    if not location.endswith(".py") or Path(location).is_absolute():  # other entries as given
        return factory
    folders = dict.fromkeys([request.path.parent, request.config.rootpath])
    for folder in folders:
        if (folder / location).is_file():
            return f"{folder / location}:{name}"
    pytest.fail(f"model_parity: no {location} beside the test file or under the rootdir "
                f"(looked in {', '.join(str(f) for f in folders)}); give the path from "
                "either", pytrace=False)
