"""Progress of a diagnosis on stderr: one line per phase (runs, replays), through rich."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


class ProgressBar:
    """Progress on stderr through rich; a no-op when disabled."""

    def __init__(self, progress: Any) -> None:
        self.progress_bar = progress

    def phase(self, description: str, total: int | None = None) -> Callable[[], None]:
        """Start a phase; the returned function advances it (or ends it, without a total)."""
        if self.progress_bar is None:
            return lambda: None
        task = self.progress_bar.add_task(description, total=total or 1)
        return lambda: self.progress_bar.advance(task)


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
