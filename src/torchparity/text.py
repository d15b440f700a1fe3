"""Plain text for logs and pipes: lines of at most 80 columns, wrapped at spaces, never cut.

A CI log has no width and is searched for module names and paths: a word longer than a line is
folded across lines, every character kept.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

#: The width of what torchparity prints where the output has none (a log, a pipe).
WIDTH = 80


def wrap(text: str, width: int = WIDTH) -> list[str]:
    """``text`` in lines of at most ``width`` columns, later ones indented by two."""
    return textwrap.wrap(text, width, subsequent_indent="  ", break_long_words=True,
                         break_on_hyphens=False) or [""]


def wrapped(text: str, width: int = WIDTH) -> str:
    """:func:`wrap`'s lines joined by newlines."""
    return "\n".join(wrap(text, width))


def print_trimmed(console: Console, what: str | RenderableType) -> None:
    """Print ``what`` (a str as plain text, never markup) as rich lays it out, without the
    spaces rich leaves at the end of a wrapped line or a table's row (a CI log keeps them)."""
    from rich.text import Text

    renderable = Text(what) if isinstance(what, str) else what
    for segments in console.render_lines(renderable, console.options, pad=False):
        line = Text.assemble(*((s.text, s.style) for s in segments if not s.control))
        line.rstrip()
        console.print(line, no_wrap=True, overflow="ignore", crop=False)


def with_article(word: str) -> str:
    """``word`` after its indefinite article: ``an int``, ``a list``, ``a uint8``, ``an MLP``."""
    lower = word.lower()
    if word[:2].isupper():  # an acronym is read letter by letter
        sounds_vowel = word[0] in "AEFHILMNORSX"
    else:
        sounds_vowel = lower[:1] in "aeio" or (lower.startswith("un") and lower[2:3] != "i")
    return f"{'an' if sounds_vowel else 'a'} {word}"
