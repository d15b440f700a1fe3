"""The account of the gpu cells: a ``-m gpu`` run cannot pass by skipping.

A *cell* is a test marked ``gpu`` and parametrized by ``backend`` and ``dtype`` (the tests of
``tests/test_gpu.py``). The terminal summary lists per backend and dtype how many cells ran,
ran their forward pass only (through the ``gpu_cell`` fixture, where the backend has no
backward), failed and were skipped, with each reason; a backend that the machine offers in a
dtype (``torchparity.backends.available``) but that ran none of its cells, not even forward
only, fails the run, with one line naming it. So does ``sdpa-math`` on any present device
whatever the probe says (PyTorch's math kernel runs everywhere), and a backend whose probe
raised. Reports reach these hooks on the xdist controller too, so ``-n`` works.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from dataclasses import dataclass, field
from typing import NoReturn

import pytest
import torch

from torchparity import backends
from torchparity.pytest_plugin import gpu_device
from torchparity.train.trainer import DTYPE_MODES

_CELL = "torchparity-gpu-cell"
_FORWARD_ONLY = "torchparity-gpu-forward-only"
# PyTorch's math kernel runs on every device and dtype: a probe that says otherwise hides an
# error of the wrapper, so its cells must run whatever the probe says.
_RUNS_EVERYWHERE = "sdpa-math"
_WIDTH = 80


@dataclass
class CellRow:
    """What became of the cells of one backend in one dtype."""

    ran: int = 0
    forward_only: Counter[str] = field(default_factory=Counter)  # reason -> number of cells
    failed: int = 0
    skipped: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return (self.ran + sum(self.forward_only.values()) + self.failed
                + sum(self.skipped.values()))


class GpuCell:
    """What a gpu cell may tell the account about itself."""

    def __init__(self, node: pytest.Item) -> None:
        self.node = node

    def forward_only(self, reason: str) -> NoReturn:
        """End the cell after its forward pass was checked: the backend has no backward here
        (``reason``). The account counts it apart from the cells that ran in full."""
        self.node.user_properties.append((_FORWARD_ONLY, reason))
        pytest.skip(f"forward matches the golden; no backward here: {reason}")


@pytest.fixture
def gpu_cell(request: pytest.FixtureRequest) -> GpuCell:
    """The running cell's line to the account (see :class:`GpuCell`)."""
    return GpuCell(request.node)


class GpuCellAccount:
    """Collects every cell's outcome and judges, at the end, whether the offered backends ran."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.cells: dict[str, tuple[str, str]] = {}  # node id -> (backend, dtype)
        self.failed: set[str] = set()
        self.skipped: dict[str, str] = {}  # node id -> reason
        self.forward_only: dict[str, str] = {}  # node id -> why there was no backward
        self.passed: set[str] = set()
        self.unrun: list[str] = []  # one line per offered backend and dtype that ran nothing

    @pytest.hookimpl
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        # The tag travels on the item's reports, which xdist carries to the controller.
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if item.get_closest_marker("gpu") and "backend" in params and "dtype" in params:
                item.user_properties.append((_CELL, (params["backend"], params["dtype"])))

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        cell = next((tuple(v) for k, v in report.user_properties if k == _CELL), None)
        if cell is None:
            return
        self.cells[report.nodeid] = cell
        if report.failed:
            self.failed.add(report.nodeid)
        elif report.skipped:
            no_backward = [v for k, v in report.user_properties if k == _FORWARD_ONLY]
            if no_backward:
                self.forward_only[report.nodeid] = " ".join(no_backward[0].split())
            else:
                self.skipped[report.nodeid] = _skip_reason(report)
        elif report.when == "call":
            self.passed.add(report.nodeid)

    def rows(self) -> dict[tuple[str, str], CellRow]:
        """(backend, dtype) -> its row, in the order of backends.names() and of the dtypes."""
        rank = {name: i for i, name in enumerate([*backends.names(), *DTYPE_MODES])}
        cells = sorted(set(self.cells.values()),
                       key=lambda cell: [rank.get(name, len(rank)) for name in cell])
        rows = {cell: CellRow() for cell in cells}
        for nodeid, cell in self.cells.items():
            row = rows[cell]
            if nodeid in self.failed:
                row.failed += 1
            elif nodeid in self.forward_only:
                row.forward_only[self.forward_only[nodeid]] += 1
            elif nodeid in self.skipped:
                row.skipped[self.skipped[nodeid]] += 1
            elif nodeid in self.passed:
                row.ran += 1
        return rows

    def offer(self, backend: str, dtype: str) -> str:
        """Whether the machine offers ``backend`` in ``dtype``: "yes", "no", or "error" when
        the probe itself raised (a kernel that was selected and then crashed)."""
        mode = DTYPE_MODES[dtype]
        try:
            reasons = backends.available(gpu_device(self.config),
                                         mode.autocast_dtype or mode.param_dtype)
        except Exception:  # the cells report the error itself
            return "error"
        return "yes" if reasons.get(backend, "unknown backend") is None else "no"

    def must_run(self, backend: str, dtype: str) -> str | None:
        """Why some cell of ``backend`` in ``dtype`` had to run here, or None."""
        offer = self.offer(backend, dtype)
        if offer == "yes":
            return "offered"
        if offer == "error":
            return "its probe raised"
        device = torch.device(gpu_device(self.config))
        if backend == _RUNS_EVERYWHERE and (device.type != "cuda" or torch.cuda.is_available()):
            return "math runs anywhere"
        return None

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(self.config, "workerinput"):
            return  # an xdist worker: the controller sees every report and judges
        device = gpu_device(self.config)
        for (backend, dtype), row in self.rows().items():
            why = self.must_run(backend, dtype)
            if why and row.ran == 0 and not row.forward_only:
                self.unrun.append(f"{backend} {dtype} on {device}: ran 0 of {row.total} cells, "
                                  f"though {why}")
        if self.unrun and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter) -> None:
        rows = self.rows()
        markexpr = self.config.getoption("markexpr") or ""
        if not rows or ("gpu" not in markexpr and not self.passed and not self.failed):
            return
        device = gpu_device(self.config)
        write = terminalreporter.write_line
        terminalreporter.section(f"torchparity gpu cells on {device}")
        write(f"{'backend':16s}{'dtype':7s}{'offered':>8s}{'ran':>6s}{'forward only':>14s}"
              f"{'failed':>8s}{'skipped':>9s}")
        for (backend, dtype), row in rows.items():
            write(f"{backend:16s}{dtype:7s}{self.offer(backend, dtype):>8s}{row.ran:>6d}"
                  f"{sum(row.forward_only.values()):>14d}{row.failed:>8d}"
                  f"{sum(row.skipped.values()):>9d}")
            for reasons, outcome in ((row.forward_only, "forward only"), (row.skipped, "skipped")):
                for reason, count in reasons.items():
                    for line in _wrap(f"{count} {outcome}: {reason}"):
                        write(line)
        for unrun in self.unrun:
            for line in _wrap(unrun, indent=""):
                write(line, red=True, bold=True)


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return " ".join(reason.removeprefix("Skipped: ").split())


def _wrap(text: str, indent: str = "  ") -> list[str]:
    # Whole words only: a module name or a path is never cut.
    return textwrap.wrap(text, _WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_long_words=False, break_on_hyphens=False)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(GpuCellAccount(config), "torchparity-gpu-cells")
