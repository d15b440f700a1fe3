"""The processes a test leaves behind."""

from __future__ import annotations

from pathlib import Path


def leftover(marker: str) -> list[str]:
    """The command lines of processes still running with ``marker`` in them."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended while we looked
            continue
        if marker in f"{text} ":
            found.append(text)
    return found
