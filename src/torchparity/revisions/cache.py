"""Base results kept between runs, one folder per key.

The key hashes everything that changes what the base side makes: the base commit, the
entries, the command that ran and its options, the contents of input files named on the
command line (``--tokens``), and the versions that change numerics in the base's interpreter
(torch, transformers, numpy, torchparity and its golden schema) with the CPU instruction set
torch dispatches. An entry is written to a temporary folder and renamed into place, so a
half-written one is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

#: Moves the cache (default: ``torchparity`` under ``$XDG_CACHE_HOME``, else ``~/.cache``).
CACHE_ENV = "TORCHPARITY_CACHE_DIR"
_KEY_FILE = "key.json"


def cache_root() -> Path:
    """Where base results are kept between runs.

    Returns:
        ``$TORCHPARITY_CACHE_DIR/base``, else ``torchparity/base`` under ``$XDG_CACHE_HOME``
        (default ``~/.cache``).
    """
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit) / "base"
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "torchparity" / "base"


def cache_key(parts: dict[str, object]) -> str:
    """A short hash of everything that changes what the base side makes.

    Args:
        parts: the commit, entries, command, options, file contents and versions; JSON
            values.

    Returns:
        20 hex digits, the entry's folder name.
    """
    text = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def lookup(key: str) -> Path | None:
    """The folder kept under ``key``, if a run finished writing it.

    Args:
        key: a :func:`cache_key`.

    Returns:
        The folder, or None.
    """
    folder = cache_root() / key
    return folder if (folder / _KEY_FILE).is_file() else None


def staging() -> Path:
    """An empty folder for an entry to be written into, in the cache's own file system.

    Being there, :func:`keep` moves it into place by a rename: a half-written entry is never
    read.

    Returns:
        The new folder.
    """
    cache_root().mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".staging-", dir=cache_root()))


def keep(key: str, parts: dict[str, object], staged: Path) -> Path:
    """Move ``staged`` into place under ``key``, replacing an older entry, with its parts.

    When another run put the same entry there first, that one is kept.

    Args:
        key: a :func:`cache_key`.
        parts: what the key hashes, written beside the entry for a person to read.
        staged: the folder of :func:`staging` the entry was written into.

    Returns:
        The entry's folder.
    """
    (staged / _KEY_FILE).write_text(json.dumps(parts, indent=1, sort_keys=True) + "\n")
    folder = cache_root() / key
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    try:
        staged.rename(folder)
    except OSError:
        if lookup(key) is None:
            raise
        shutil.rmtree(staged, ignore_errors=True)
    return folder
