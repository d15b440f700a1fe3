"""Sections of docs/tolerance.md that a study writes on its own, between two markers: a run of
one study replaces its section and keeps the others'."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MarkedSection:
    """A section between the ``begin`` and ``end`` marker lines."""

    begin: str
    end: str

    def merged(self, document: str, section: str) -> str:
        """``document`` with this section replaced by ``section`` (appended when it has none)."""
        if self.begin in document and self.end in document:
            head, _, rest = document.partition(self.begin)
            return head + section.strip("\n") + rest.partition(self.end)[2]
        return document.rstrip("\n") + "\n\n" + section

    def of(self, document: str) -> str | None:
        """This section of ``document``, None when it has none."""
        if self.begin not in document or self.end not in document:
            return None
        inside = document.partition(self.begin)[2].partition(self.end)[0]
        return self.begin + inside + self.end + "\n"
