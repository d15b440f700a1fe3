"""pytest plugin: the ``golden``, ``twins`` and ``torchparity_device`` fixtures and an opt-in
``gpu`` marker.

Loaded through the ``pytest11`` entry point into every pytest run of an environment where
torchparity is installed (or by the root ``conftest.py`` of a source tree), so it changes
nothing a suite did not ask for: its options are namespaced (``--torchparity-...``), its
fixtures act only when a test requests them, torch is imported only by them, and the ``gpu``
marker is registered and acted on only in suites that opt in with the ini option
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
    """Add torchparity's options, namespaced so they clash with no suite's own.

    Args:
        parser: pytest's parser.
    """
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
    """Register the ``gpu`` marker, only in a suite that opts in and has not registered it.

    Args:
        config: pytest's config.
    """
    if config.getini(GPU_MARKER_INI) and not _marker_registered(config, GPU_MARKER):
        config.addinivalue_line(
            "markers", f"{GPU_MARKER}: runs on CUDA (or on {DEVICE_OPTION}); skipped without it")


def _marker_registered(config: pytest.Config, name: str) -> bool:
    return any(line.split(":")[0].split("(")[0].strip() == name
               for line in config.getini("markers"))


def gpu_device(config: pytest.Config) -> str:
    """The device tests marked ``gpu`` run on.

    Args:
        config: pytest's config.

    Returns:
        ``--torchparity-device``, else ``cuda``.
    """
    return config.getoption("torchparity_device") or "cuda"


#: Why a test marked ``gpu`` is skipped on a machine without CUDA.
NO_CUDA = f"no CUDA device here; '{DEVICE_OPTION} cpu' runs these tests' logic on the CPU"


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test marked ``gpu`` without CUDA, in a suite that opted in.

    The skip is raised here, not marked on each test, so pytest's summary counts them all
    on one line rather than one per test.

    Args:
        item: the test about to run.
    """
    config = item.config
    if not config.getini(GPU_MARKER_INI) or not item.get_closest_marker(GPU_MARKER):
        return
    if gpu_device(config).startswith("cuda") and not _cuda_available():
        pytest.skip(NO_CUDA)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.fixture
def torchparity_device(request: pytest.FixtureRequest) -> str:
    """The device a test runs on.

    Returns:
        ``cpu``; for tests marked ``gpu`` in a suite that set ``torchparity_gpu_marker``, the
        ``--torchparity-device`` (default ``cuda``).
    """
    if request.config.getini(GPU_MARKER_INI) and request.node.get_closest_marker(GPU_MARKER):
        return gpu_device(request.config)
    return "cpu"


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Iterator[GoldenFixture]:
    """Goldens of this test, kept beside its file (a :class:`GoldenFixture`).

    ``golden.check("name", tensors, kind="forward")`` compares with it. With
    ``--torchparity-golden-update`` it writes the golden instead, and the test fails at
    teardown with "golden written, rerun without --torchparity-golden-update", so the option
    cannot be left on.

    Yields:
        The fixture.
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

    The examples are drawn by :func:`torchparity.twins.search.check_twins`; those that failed
    are kept in hypothesis' database under this test's id and tried first next time. See
    docs/twins.md.

    Returns:
        ``check_twins`` with this test's database key: it returns how many examples passed.
    """
    from torchparity.twins.search import check_twins

    return functools.partial(check_twins, database_key=request.node.nodeid)


def add_summary_line(node: pytest.Item, section: str, line: str) -> None:
    """Show ``line`` under ``section`` in the terminal summary (goldens written, throughput, ...).

    It travels on the test report, so it works under xdist too.

    Args:
        node: the test adding it.
        section: the summary's section title.
        line: the line, shown once however many tests add it.
    """
    node.user_properties.append((_SUMMARY_KEY, (section, line)))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Print the lines tests added with :func:`add_summary_line`, by section.

    Args:
        terminalreporter: pytest's terminal reporter.
        exitstatus: the session's exit status (unused).
        config: pytest's config.
    """
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

    A file entry's relative path is looked for beside the test file, then under pytest's
    rootdir, whatever the working directory. Goldens are read from ``golden/`` beside the
    test file unless ``golden_dir`` is given; ``torchparity golden update --model ENTRY
    --golden-dir DIR`` writes them. A cell in which every output is ``n/a`` (a model that
    never calls SDPA, in an ``sdpa`` cell) is skipped with the reason, which ``pytest -rs``
    shows: a test never passes a cell that did not run.

    Returns:
        The check, which returns the cell's report when it passes.
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
    """Why no output of ``report`` was judged (every row ``n/a``), or None when some was.

    Args:
        report: the check of one cell.

    Returns:
        The rows' reasons, each once, or None.
    """
    if not report.results or any(row.verdict != "n/a" for row in report.results):
        return None
    return "; ".join(dict.fromkeys(row.reason or "could not run" for row in report.results))


def _entry_for_test(factory, request: pytest.FixtureRequest):
    """``file.py:name`` with its relative path found beside the test file, else under the
    rootdir; other entries (``pkg.mod:name``, a callable, an absolute path) as given."""
    if not isinstance(factory, str):
        return factory
    location, _, name = factory.rpartition(":")
    if not location.endswith(".py") or Path(location).is_absolute():
        return factory
    folders = dict.fromkeys([request.path.parent, request.config.rootpath])
    for folder in folders:
        if (folder / location).is_file():
            return f"{folder / location}:{name}"
    pytest.fail(f"model_parity: no {location} beside the test file or under the rootdir "
                f"(looked in {', '.join(str(f) for f in folders)}); give the path from "
                "either", pytrace=False)
