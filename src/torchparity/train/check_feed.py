"""Golden training trajectories in the check: one ``trajectory`` row per case and cell.

Each cell trains the case's golden recipe (:func:`~torchparity.golden.trajectories.golden_config`)
with its backend and dtype and judges the run as ``train --check`` does
(:func:`~torchparity.golden.trajectories.check_against_golden`): the stored float64 golden as
reference, within the noise band stored for the cell's dtype (measured by the code that made
the golden, so a change of the training code itself cannot earn its own budget; a dtype with
no stored band has it trained here). The reference cell trains nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchparity import backends
from torchparity.dtypes import DTYPES
from torchparity.errors import BackendUnavailable
from torchparity.golden import check_loop
from torchparity.golden import trajectories as tj
from torchparity.golden.cells import REFERENCE, Cell, CellRun, CheckResult
from torchparity.golden.store import GoldenStore
from torchparity.train.trainer import Execution, Trajectory, train

OUTPUT = "trajectory"  # the row's output: one per case and cell, whatever its dtype


def load_trajectories(root: GoldenStore | str, cases: list[str]) -> GoldenStore:
    """The store of the golden trajectories under ``root``, every case's golden validated.

    Args:
        root: the store, or its folder.
        cases: the cases trained.

    Returns:
        The store.

    Raises:
        GoldenError: a golden is missing, damaged or stale, before any training.
    """
    store = tj.golden_store(root.root if isinstance(root, GoldenStore) else root)
    for case in cases:
        for dtype in tj.STORED_DTYPES:
            tj.read_golden_trajectory(case, dtype, store)
    return store


def check_trajectories(store: GoldenStore, cases: list[str], cells: list[Cell],
                       advance: Callable[[str], None] = lambda label: None,
                       ) -> list[CheckResult]:
    """Train and judge every case in every cell but the reference one.

    A backend that cannot train here (flex without a CPU backward, a CUDA-only kernel) gives
    an ``n/a`` row with the reason.

    Args:
        store: the golden trajectories.
        cases: the cases trained.
        cells: the cells.
        advance: called with each cell's label when it is done.

    Returns:
        One row per case and cell.
    """
    trained = [cell for cell in cells if cell != REFERENCE]
    return [result for case in cases for result in check_loop.check_cells(
        TrajectoryFeed(store, case), trained,
        lambda label, case=case: advance(f"{case} {label} trajectory"))]


class TrajectoryFeed:
    """A case's golden training recipe as the check loop runs and judges it (see
    :class:`check_loop.Feed`): its one output is the trajectory."""

    kinds = {OUTPUT: "trajectory"}
    outputs = (OUTPUT,)
    unjudged: dict[str, str] = {}
    noise_from = OUTPUT  # a trajectory has no loss output to carry noise into

    def __init__(self, store: GoldenStore, case: str) -> None:
        self.store, self.name, self.config = store, case, tj.golden_config(case)
        self._untrained: dict[tuple[str, str], str] = {}  # baselines that cannot train here

    def changed(self) -> dict[str, tuple[str, str]]:
        """Nothing: a trajectory's golden records no weights; its recipe trains them."""
        return {}  # a trajectory's golden records no weights: its recipe trains them

    def refused(self, cell: Cell) -> str | None:
        """Why the cell's backend is unavailable on its device and dtype, or None."""
        return backends.available(cell.device, DTYPES[cell.dtype])[cell.backend]

    def run(self, cell: Cell, *, perturb: bool = False) -> CellRun:
        """The case trained in ``cell``; a baseline that cannot train is noted for the judge."""
        try:
            return CellRun({OUTPUT: train(self.config, Execution(cell.backend, cell.dtype,
                                                             cell.device))}, {})
        except BackendUnavailable as exc:
            if cell.backend == "manual":
                self._untrained[cell.dtype, cell.device] = str(exc)
            return CellRun({}, {OUTPUT: str(exc)})

    def golden(self, output: str) -> None:
        """None: :func:`~torchparity.golden.trajectories.check_against_golden` reads the store."""
        return None  # read by check_against_golden from the store

    def judge(self, cell: Cell, output: str, candidate: Trajectory, golden: None,
              baseline: Trajectory | None, noise: float | None = None) -> CheckResult:
        """The trajectory's row: n/a where the baseline could not train (see :meth:`Feed.judge`)."""
        if baseline is None:
            return check_loop.row(self, cell, output, "n/a", ok=True,
                                  reason=self._untrained[cell.dtype, cell.device])
        comparison = tj.check_against_golden(candidate, self.store)
        worst = comparison.first_divergence or comparison.worst
        return check_loop.row(self, cell, output, comparison.verdict, ok=comparison.ok,
                              headroom=comparison.max_headroom, explain=comparison.explain(),
                              worst=f"{worst.quantity} at step {worst.step}" if worst else None)

    def self_checks(self, fresh: CellRun) -> list[CheckResult]:
        """Nothing: the reference cell trains nothing."""
        return []  # the reference cell trains nothing

    def steps(self, decoded: Any) -> list[dict[str, Any]]:
        """Nothing: a trajectory decodes nothing."""
        return []  # a trajectory decodes nothing
