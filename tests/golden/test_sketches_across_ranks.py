"""A big gradient held in parts by the ranks is sketched without any rank holding it whole,
and the sketch is the one a single process makes of the whole tensor, bit for bit: so the
goldens on disk do not depend on how many ranks made them. A rank's part of a float64 weight
is perturbed as the whole is (the reference cell's second run).

Two ranks under torchrun (one launch, a few seconds of imports) run the check below on a
tensor of known values sharded by rows, by columns, replicated, and on a 2-D mesh."""

from __future__ import annotations

import json
import os
from pathlib import Path

from torchparity.distributed import launch

RANKS_SCRIPT = '''
import json
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from torchparity import sketching
from torchparity.golden.model_runs import perturbation
from torchparity.golden.sharded import kept_across_ranks, perturbation_in_parts
from torchparity.distributed import group, sharding
from torchparity.subject import slices

group.join()
whole = torch.randn(300, 500, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
whole[0, 1], whole[299, 7], whole[150, 3] = -0.0, float("nan"), float("-inf")
expected = sketching.sketch(whole, "layers.0.w")
flat_bits = whole.reshape(-1).view(torch.int64)
found = {}
meshes = {"1-D": init_device_mesh("cpu", (2,)), "2-D": init_device_mesh("cpu", (2, 1))}
for label, mesh, placements in [
        ("rows", "1-D", [Shard(0)]), ("columns", "1-D", [Shard(1)]),
        ("replicated", "1-D", [Replicate()]), ("2-D", "2-D", [Shard(1), Replicate()])]:
    part = distribute_tensor(whole, meshes[mesh], placements)
    runs = torch.cat(list(sharding.flat_chunks(part, 4096)))  # runs cross the parts' edges
    kept = kept_across_ranks("layers.0.w", part)
    # In place, on this rank's part of a copy (a run perturbs its own float64 cast).
    moved = perturbation_in_parts("layers.0.w", distribute_tensor(whole.clone(),
                                                                  meshes[mesh], placements))
    moved_whole = slices.part(perturbation("layers.0.w", whole.clone()), moved)
    found[label] = {"runs": torch.equal(runs.view(torch.int64), flat_bits),
                    "sketch": isinstance(kept, sketching.Sketch) and kept.same_values(expected),
                    "perturbed": torch.equal(moved.to_local().view(torch.int64),
                                             moved_whole.contiguous().view(torch.int64))}
if group.rank() == 0:
    with open(sys.argv[1], "w") as out:
        json.dump(found, out)
group.leave()
'''


def test_a_gradient_in_parts_is_sketched_as_one_process_sketches_it_whole(tmp_path, monkeypatch):
    (tmp_path / "sketch_across_ranks.py").write_text(RANKS_SCRIPT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    result = tmp_path / "found.json"
    outcome = launch.launch("sketch_across_ranks", [str(result)], nproc=2, timeout=300)
    assert outcome.status == 0, outcome.message
    found = json.loads(Path(result).read_text())
    assert found == {label: {"runs": True, "sketch": True, "perturbed": True}
                     for label in ("rows", "columns", "replicated", "2-D")}
