"""Which of a model's weight tensors differ from those its goldens were made from, by name.

Goldens record, beside one checksum of all the weights, each weight tensor's rows hashed in
blocks (:func:`row_blocks`): a power of two of rows per block, the fewest that keep a tensor
to :data:`MAX_BLOCKS` blocks (every row its own block up to 64 rows). A model whose weights'
checksum differs is hashed the same way under the goldens' names, and the tensors whose blocks
differ are named in the model's names (:func:`changed_sentence`), through the renaming of
:mod:`torchparity.golden.renamed`: a part of a fused golden tensor by the rows it is there, a
part of the model's fused tensor by its rows in it. A part is told from its neighbours where
its rows start on a block's first row (always, up to 64 rows); otherwise a changed block it
shares names both.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

from torchparity import digests
from torchparity.golden.renamed import Layout, Piece, Renaming

#: The most blocks a tensor's rows are hashed in.
MAX_BLOCKS = 64
#: Hex digits kept of each block's sha256: the checksum of all the weights says whether they
#: changed, the blocks only where.
DIGITS = 8
#: The tensors a sentence names before "and N more".
NAMED = 3

#: A tensor's blocks as goldens record them: rows per block, and the blocks' digests joined.
Blocks = dict[str, int | str]


def row_blocks(tensors: Mapping[str, torch.Tensor], names: Iterable[str]) -> dict[str, Blocks]:
    """The rows of each tensor of ``names`` hashed in blocks (floating tensors in float64).

    Args:
        tensors: the tensors by name.
        names: those hashed, in the order they are read (the same on every rank).

    Returns:
        Name -> ``{"block_rows": rows per block, "blocks": the blocks' digests joined}``.
    """
    blocks = {}
    for name in names:
        tensor = tensors[name]
        per_block = _block_rows(tensor)
        blocks[name] = {"block_rows": per_block, "blocks": "".join(_digests(tensor, per_block))}
    return blocks


def changed_rows(stored: Mapping[str, Blocks], tensors: Mapping[str, torch.Tensor]
                 ) -> dict[str, list[range]]:
    """The goldens' tensors whose rows differ from ``tensors``', with the rows that do.

    Args:
        stored: the blocks the goldens record, by the goldens' names.
        tensors: the model's tensors by the goldens' names.

    Returns:
        Name -> the stretches of rows whose blocks differ (every row where the tensor is
        missing, or its shape changed the number of blocks), in the goldens' order.
    """
    changed = {}
    for name, recorded in stored.items():
        per_block, joined = int(recorded["block_rows"]), str(recorded["blocks"])
        before = [joined[i:i + DIGITS] for i in range(0, len(joined), DIGITS)]
        tensor = tensors.get(name)
        now = _digests(tensor, per_block) if tensor is not None else []
        if now == before:
            continue
        if len(now) != len(before):
            changed[name] = [range(0, len(before) * per_block)]
            continue
        changed[name] = [range(i * per_block, (i + 1) * per_block)
                         for i, (old, new) in enumerate(zip(before, now, strict=True))
                         if old != new]
    return changed


def changed_sentence(changed: Mapping[str, list[range]], renamed: Renaming | None,
                     model: Layout) -> str:
    """The model's tensors that ``changed`` names, for an ``init changed`` reason.

    Args:
        changed: the goldens' tensors and rows that differ (:func:`changed_rows`).
        renamed: how the goldens' tensors are found in the model, or None for the same names.
        model: the model's layout, which counts its tensors.

    Returns:
        ``in 1 of 16 tensors: attn.k.weight (the goldens' attn.qkv.weight rows 16-31)``: at
        most :data:`NAMED` of them, then how many more.
    """
    holders = _holders(renamed) if renamed is not None else {}
    said = [told for name, rows in changed.items()
            for told in _told(name, rows, holders.get(name), renamed)]
    tensors = len({tensor for tensor, _ in said})
    total = sum(not isinstance(shape, str) for shape in model.values())
    words = [words for _, words in said]
    more = f" and {len(words) - NAMED} more" if len(words) > NAMED else ""
    return f"in {tensors} of {total} tensors: {', '.join(words[:NAMED])}{more}"


def _holders(renamed: Renaming) -> dict[str, tuple[str, Piece, int]]:
    """The goldens' tensors the model holds under another name: ``(the model's tensor, the
    golden's piece of it, how many pieces it has)``."""
    return {piece.name: (whole, piece, len(pieces))
            for whole, pieces in renamed.pieces.items() for piece in pieces}


def _told(name: str, rows: list[range], holder: tuple[str, Piece, int] | None,
          renamed: Renaming | None) -> list[tuple[str, str]]:
    """The golden tensor ``name``, whose ``rows`` differ, as the model's tensors that hold
    them: ``(model tensor, words)``."""
    parts = renamed.splits.get(name) if renamed is not None else None
    if parts is not None:  # the model splits it: the parts whose rows differ
        return [(p.name, f"{p.name} (the goldens' {name} rows {p.start}-{p.start + p.rows - 1})")
                for p in parts if any(_overlap(r, p.start, p.rows) for r in rows)]
    if holder is None:
        return [(name, name)]
    whole, piece, pieces = holder
    if pieces == 1:  # renamed
        return [(whole, f"{whole} (the goldens' {name})")]
    return [(whole, f"{whole} rows {piece.start}-{piece.start + piece.rows - 1} "
                    f"(the goldens' {name})")]


def _overlap(rows: range, start: int, count: int) -> bool:
    return rows.start < start + count and start < rows.stop


def _block_rows(tensor: torch.Tensor) -> int:
    """The fewest rows per block, a power of two, that keep ``tensor`` to MAX_BLOCKS blocks."""
    rows, per_block = tensor.shape[0] if tensor.dim() else 1, 1
    while -(-rows // per_block) > MAX_BLOCKS:
        per_block *= 2
    return per_block


def _digests(tensor: torch.Tensor, per_block: int) -> list[str]:
    """``tensor``'s rows hashed ``per_block`` at a time, each block with its dtype and shape."""
    rows = tensor.reshape(1, *tensor.shape) if not tensor.dim() else tensor
    target = torch.float64 if tensor.is_floating_point() else tensor.dtype
    hashed = []
    for start in range(0, max(rows.shape[0], 1), per_block):
        block = rows[start:start + per_block]
        digest = hashlib.sha256(
            f"{str(target).removeprefix('torch.')}|{list(block.shape)}|".encode())
        digests.update(digest, block, target)
        hashed.append(digest.hexdigest()[:DIGITS])
    return hashed
