"""Which of a model's weight tensors differ from those its goldens were made from, by name.

Goldens record each weight tensor's rows hashed in blocks (:func:`row_blocks`: the fewest
power-of-two rows per block within :data:`MAX_BLOCKS`, every row its own up to 64). Where the
weights' checksum differs, the tensors whose blocks differ are named in the model's names through
the renaming, a fused part by its rows; a part starting mid-block shares its name with its
neighbour's.
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
    """Name -> ``{"block_rows", "blocks"}``: each of ``names`` hashed in row blocks (float64)."""
    blocks = {}
    for name in names:
        tensor = tensors[name]
        per_block = _block_rows(tensor)
        blocks[name] = {"block_rows": per_block, "blocks": "".join(_digests(tensor, per_block))}
    return blocks


def changed_rows(stored: Mapping[str, Blocks], tensors: Mapping[str, torch.Tensor]
                 ) -> dict[str, list[range]]:
    """The goldens' tensors whose rows differ from ``tensors``', with the stretches that do."""
    changed = {}
    for name, recorded in stored.items():
        per_block, joined = int(recorded["block_rows"]), str(recorded["blocks"])
        before = [joined[i:i + DIGITS] for i in range(0, len(joined), DIGITS)]
        tensor = tensors.get(name)
        now = _digests(tensor, per_block) if tensor is not None else []
        if now == before:
            continue
        # a missing tensor, or one whose shape changed the blocks: every row
        if len(now) != len(before):
            changed[name] = [range(0, len(before) * per_block)]
            continue
        changed[name] = [range(i * per_block, (i + 1) * per_block)
                         for i, (old, new) in enumerate(zip(before, now, strict=True))
                         if old != new]
    return changed


def changed_sentence(changed: Mapping[str, list[range]], renamed: Renaming | None,
                     model: Layout) -> str:
    """``in 1 of 16 tensors: attn.k.weight (the goldens' attn.qkv.weight rows 16-31)``."""
    holders = _holders(renamed) if renamed is not None else {}
    said = [told for name, rows in changed.items()
            for told in _told(name, rows, holders.get(name), renamed)]
    tensors = len({tensor for tensor, _ in said})
    total = sum(not isinstance(shape, str) for shape in model.values())
    words = [words for _, words in said]
    more = f" and {len(words) - NAMED} more" if len(words) > NAMED else ""
    return f"in {tensors} of {total} tensors: {', '.join(words[:NAMED])}{more}"


def _holders(renamed: Renaming) -> dict[str, tuple[str, Piece, int]]:
    """The goldens' tensors the model holds otherwise: ``(its tensor, the piece, pieces)``."""
    return {piece.name: (whole, piece, len(pieces))
            for whole, pieces in renamed.pieces.items() for piece in pieces}


def _told(name: str, rows: list[range], holder: tuple[str, Piece, int] | None,
          renamed: Renaming | None) -> list[tuple[str, str]]:
    """The golden tensor ``name``, whose ``rows`` differ, as the model's tensors holding them."""
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
