"""Plain text for logs and pipes: lines of at most 80 columns, wrapped at spaces, never cut.

A CI log has no width and is searched for module names and paths, so a long line is wrapped
between words (later lines indented); a word longer than a line is folded across lines as the
tables fold a long name, every character kept.
"""

from __future__ import annotations

import textwrap

#: The width of what torchparity prints where the output has none (a log, a pipe).
WIDTH = 80


def wrap(text: str, width: int = WIDTH) -> list[str]:
    """``text`` in lines of at most ``width`` columns, wrapped at spaces, never shortened.

    Args:
        text: one paragraph.
        width: the columns of a line.

    Returns:
        The lines, later ones indented by two; a module name or a path longer than a line is
        folded across lines. One empty line for empty text.
    """
    return textwrap.wrap(text, width, subsequent_indent="  ", break_long_words=True,
                         break_on_hyphens=False) or [""]


def wrapped(text: str, width: int = WIDTH) -> str:
    """:func:`wrap`'s lines joined, one paragraph.

    Args:
        text: one paragraph.
        width: the columns of a line.

    Returns:
        The lines joined by newlines.
    """
    return "\n".join(wrap(text, width))
