"""Goldens: the store (files, checksums, atomic writes) and the subjects checked against it."""

from torchparity.golden.store import (
    Golden,
    GoldenCorrupt,
    GoldenError,
    GoldenMissing,
    GoldenSchemaError,
    GoldenStale,
    GoldenStore,
    checksum,
    default_golden_dir,
)

__all__ = [
    "Golden", "GoldenCorrupt", "GoldenError", "GoldenMissing", "GoldenSchemaError",
    "GoldenStale", "GoldenStore", "checksum", "default_golden_dir",
]
