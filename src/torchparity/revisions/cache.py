"""Base results kept between runs, one folder per key.

The key hashes everything that changes what the base makes: the commit, entries, command,
options, input files, the versions that change numerics (torch, transformers, numpy, torchparity
and its golden schema) and the CPU instruction set. Entries are written aside and renamed into
place, so a half-written one is never read.
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
    """Where base results live: ``$TORCHPARITY_CACHE_DIR/base``, else in the user's cache."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit) / "base"
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "torchparity" / "base"


def cache_key(parts: dict[str, object]) -> str:
    """20 hex digits hashing ``parts`` (JSON values): the entry's folder name."""
    text = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def lookup(key: str) -> Path | None:
    """The folder kept under ``key``, if a run finished writing it, else None."""
    folder = cache_root() / key
    return folder if (folder / _KEY_FILE).is_file() else None


def staging() -> Path:
    """An empty folder in the cache's own file system, so :func:`keep` moves it in by a rename."""
    cache_root().mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=".staging-", dir=cache_root()))


def keep(key: str, parts: dict[str, object], staged: Path) -> Path:
    """Move ``staged`` into place under ``key``, replacing an older entry, ``parts`` beside."""
    (staged / _KEY_FILE).write_text(json.dumps(parts, indent=1, sort_keys=True) + "\n")
    folder = cache_root() / key
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    try:
        staged.rename(folder)
    # another run put the same entry there first: that one is kept
    except OSError:
        if lookup(key) is None:
            raise
        shutil.rmtree(staged, ignore_errors=True)
    return folder
