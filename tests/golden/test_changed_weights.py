"""The weight tensors that differ from the goldens', named from the rows each tensor's
checksums keep: a power of two of rows per block, at most 64 blocks a tensor."""

from __future__ import annotations

import torch

from torchparity.golden.changed_weights import changed_rows, changed_sentence, row_blocks
from torchparity.golden.renamed import renaming


def test_a_changed_row_of_a_long_tensor_is_placed_in_its_block():
    weights = {"w": torch.arange(1000 * 3, dtype=torch.float32).reshape(1000, 3),
               "scale": torch.tensor(2.0), "steps": torch.arange(5)}
    stored = row_blocks(weights, weights)
    # 1000 rows: 16 rows a block is the first power of two giving at most 64 (63) blocks.
    assert stored["w"]["block_rows"] == 16 and len(stored["w"]["blocks"]) == 63 * 8
    moved = dict(weights, w=weights["w"].clone())
    moved["w"][700, 1] *= 1.01
    assert changed_rows(stored, moved) == {"w": [range(688, 704)]}
    assert changed_rows(stored, weights) == {}
    # The same values as float64 are the same weights: they are hashed in float64.
    assert changed_rows(stored, dict(weights, w=weights["w"].double())) == {}


def test_the_sentence_names_a_few_tensors_then_counts_the_rest():
    names = [f"blocks.{i}.ln1.weight" for i in range(5)]
    changed = {name: [range(0, 1)] for name in names}
    layout = {**{name: [4] for name in [*names, "head.weight"]}, "tied.weight": "head.weight"}
    assert changed_sentence(changed, None, layout) == (
        "in 5 of 6 tensors: blocks.0.ln1.weight, blocks.1.ln1.weight, blocks.2.ln1.weight "
        "and 2 more")


def test_a_split_part_is_named_by_its_rows_and_a_shared_block_names_both_parts():
    # Goldens of one qkv of 200 rows (blocks of 4 rows); the model's q, k, v of 100, 50, 50
    # rows: v starts at row 150, inside the block of rows 148-151.
    paired = renaming({"qkv.weight": [200, 2]},
                      {"q.weight": [100, 2], "k.weight": [50, 2], "v.weight": [50, 2]})
    draws = torch.Generator().manual_seed(0)
    parts = {name: torch.randn(rows, 2, generator=draws, dtype=torch.float64)
             for name, rows in (("q.weight", 100), ("k.weight", 50), ("v.weight", 50))}
    layout = {name: list(tensor.shape) for name, tensor in parts.items()}
    stored = row_blocks(paired.golden_state(parts, layout), ["qkv.weight"])

    def named(part: str, row: int) -> str:
        moved = {name: tensor.clone() for name, tensor in parts.items()}
        moved[part][row] *= 1.01
        changed = changed_rows(stored, paired.golden_state(moved, layout))
        return changed_sentence(changed, paired, layout)

    assert named("k.weight", 20) == (
        "in 1 of 3 tensors: k.weight (the goldens' qkv.weight rows 100-149)")
    assert named("v.weight", 1) == (
        "in 2 of 3 tensors: k.weight (the goldens' qkv.weight rows 100-149), v.weight (the "
        "goldens' qkv.weight rows 150-199)")
