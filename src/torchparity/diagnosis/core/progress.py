"""Progress of a diagnosis: one line per phase (runs, replays) on stderr through rich, and the
wall time of each phase (``report.meta.seconds``), shown or not."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported only when a bar is drawn
    from rich.progress import Progress


class ProgressBar:
    """Progress on stderr through rich (none when ``progress`` is None); times every phase."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress_bar = progress
        self.seconds: dict[str, float] = {}

    def phase(self, description: str, total: int | None = None) -> Callable[[], None]:
        """Start a phase; the returned function advances it (or ends it, without a total).
        Its time runs from now to the last advance."""
        start = time.perf_counter()
        task = None if self.progress_bar is None else self.progress_bar.add_task(
            description, total=total or 1)

        def advance() -> None:
            self.seconds[description] = time.perf_counter() - start
            if task is not None:
                self.progress_bar.advance(task)

        return advance


@contextlib.contextmanager
def progress_bar(enabled: bool | None) -> Iterator[ProgressBar]:
    """A :class:`ProgressBar` that draws on stderr while the block runs (when ``enabled``)."""
    if not enabled:
        yield ProgressBar(None)
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as progress:
        yield ProgressBar(progress)
