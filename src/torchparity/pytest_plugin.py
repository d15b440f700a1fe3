"""pytest plugin: markers, the ``--device`` option and fixtures for parity tests.

Loaded through the ``pytest11`` entry point when torchparity is installed, or by the root
``conftest.py`` when the suite runs from a source tree (``PYTHONPATH=src``).
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torchparity")
    group.addoption(
        "--device", default=None,
        help="device for tests marked gpu (default: cuda). '--device cpu' runs their logic on "
             "the CPU, so a machine without a GPU can prove them.",
    )
    group.addoption(
        "--golden-update", action="store_true", default=False,
        help="create or overwrite the goldens that the 'golden' fixture checks instead of "
             "comparing with them; the summary lists the files written.",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: runs on CUDA (or on --device); skipped without it")
    config.addinivalue_line("markers", "slow: long-running; deselect with -m 'not slow'")


def gpu_device(config: pytest.Config) -> str:
    """The device tests marked ``gpu`` run on: ``--device``, else ``cuda``."""
    return config.getoption("--device") or "cuda"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    device = gpu_device(config)
    if device.startswith("cuda") and not torch.cuda.is_available():
        skip = pytest.mark.skip(
            reason="no CUDA device here; 'pytest -m gpu --device cpu' runs these tests' logic "
                   "on the CPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def device(request: pytest.FixtureRequest) -> str:
    """``cpu`` for ordinary tests; the ``--device`` (default ``cuda``) for tests marked gpu."""
    if request.node.get_closest_marker("gpu"):
        return gpu_device(request.config)
    return "cpu"


@pytest.fixture(scope="module")
def single_thread():
    """torch on one CPU thread for the module's tests, restored afterwards: tiny models run
    faster on one thread, and on a shared machine several threads contend for the cores."""
    from torchparity.golden.cases import single_thread as one_thread

    with one_thread():
        yield


_SUMMARY_KEY = "torchparity-summary"
_summary: dict[str, list[str]] = {}


@pytest.fixture
def golden(request: pytest.FixtureRequest):
    """``golden.check("name", tensors, kind="forward")`` compares with a golden kept in
    ``golden/<test module>/`` beside the test file (see
    :class:`torchparity.golden.store.GoldenFixture`); ``--golden-update`` writes it instead."""
    from torchparity.golden.store import GoldenFixture

    return GoldenFixture.for_test(
        request.path, request.node.nodeid, request.config.getoption("--golden-update"),
        lambda path: add_summary_line(request.node, "torchparity goldens written", str(path)))


def add_summary_line(node: pytest.Item, section: str, line: str) -> None:
    """Show ``line`` under ``section`` in the terminal summary (golden files written,
    measured throughput, ...). It travels on the test report, so it works under xdist too."""
    node.user_properties.append((_SUMMARY_KEY, (section, line)))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "teardown":
        return
    for key, value in report.user_properties:
        if key == _SUMMARY_KEY:
            section, line = value
            lines = _summary.setdefault(section, [])
            if line not in lines:
                lines.append(line)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for section, lines in _summary.items():
        terminalreporter.section(section)
        for line in lines:
            terminalreporter.write_line(line)
