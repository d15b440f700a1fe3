"""Whether the ranks hold alike what they must: replicated weights, and the outputs and
gradients a run keeps. Every rank sends its digests in one collective and decides on the same
evidence, raising the same :class:`~torchparity.errors.RanksDisagree` (the tensor, the ranks,
by how much): no rank branches alone before a collective."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from torchparity.digests import sha256
from torchparity.errors import RanksDisagree
from torchparity.sketching import Sketch
from torchparity.subject.slices import Slices
from torchparity.subject.trees import walk

#: A tensor's name and where its copy lies: the mesh coordinates of the dimensions it is
#: sharded over (its copies along the others must be equal).
Key = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class Disagreement:
    """A tensor whose copies differ: the ranks that hold each differing copy, the rank whose
    copy they differ from, and by how much (max-abs)."""

    name: str
    ranks: list[int]
    reference: int
    difference: float

    def explain(self, what: str) -> str:
        """One line: ``what`` (the tensor, named) differs, on which ranks, and by how much."""
        ranks = ", ".join(map(str, self.ranks))
        plural = "s" if len(self.ranks) > 1 else ""
        how = (f": NaN where rank {self.reference}'s is a number" if math.isnan(self.difference)
               else f" by up to {self.difference:.3g} (max-abs)")
        return (f"{what} differs between ranks: rank{plural} {ranks} "
                f"differ{'' if plural else 's'} from rank {self.reference}'s copy{how}")


def check_replicated(model: nn.Module, held: Slices | None = None) -> None:
    """Raise on every rank when a weight held replicated differs between ranks (a collective).

    Plain parameters and buffers are whole on every rank (unless one of ``held``'s slices); a
    DTensor's part is replicated over the mesh dimensions it is not sharded on."""
    first, count = _first_disagreement(dict(_replicated_copies(model, held)))
    if first is not None:
        more = f"; {count - 1} more weight(s) differ too" if count > 1 else ""
        raise RanksDisagree(f"{first.explain(f'the replicated weight {first.name}')}{more}; "
                            "every rank "
                            "must start from the same replicated weights (a plan or factory "
                            "that changes one rank's copy)")


def check_kept(outputs: dict[str, object], run: str) -> None:
    """Raise on every rank when the ``outputs`` every rank keeps whole of ``run`` differ (a
    collective)."""
    copies = {(path, ()): value for path, value in walk(outputs, "")
              if isinstance(value, (torch.Tensor, Sketch))}
    first, count = _first_disagreement({key: _values(value) for key, value in copies.items()},
                                       everywhere=True)
    if first is not None:
        more = f"; {count - 1} more differ too" if count > 1 else ""
        raise RanksDisagree(f"{first.explain(f'{first.name} of {run}')}{more}, though every "
                            "rank keeps it whole from the same computation")


def _values(value: torch.Tensor | Sketch) -> torch.Tensor:
    if isinstance(value, Sketch):
        return torch.cat([value.projection.reshape(-1).double(),
                          value.slices.reshape(-1).double()])
    return value


def _replicated_copies(model: nn.Module, held: Slices | None
                       ) -> Iterator[tuple[Key, torch.Tensor]]:
    from torch.distributed.tensor import DTensor, Shard

    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, tensor in tensors.items():
        if isinstance(tensor, DTensor):
            if any(p.is_partial() for p in tensor.placements):
                continue
            coordinate = tensor.device_mesh.get_coordinate() or []
            where = tuple(c if isinstance(p, Shard) else -1
                          for c, p in zip(coordinate, tensor.placements, strict=True))
            yield (name, where), tensor.to_local()
        elif held is None or held.of(name) is None:
            yield (name, ()), tensor


def _first_disagreement(copies: dict[Key, torch.Tensor], everywhere: bool = False
                        ) -> tuple[Disagreement | None, int]:
    """The first tensor whose copies differ between the ranks that share its key, and how
    many tensors differ, the same on every rank: each rank's digests are gathered first, then
    every rank decides alike. With ``everywhere``, a rank without a key differs too."""
    import torch.distributed as dist

    digests = {key: sha256(tensor.detach(), f"{tensor.dtype}{tuple(tensor.shape)}")
               for key, tensor in copies.items()}
    every: list[dict[Key, str]] = [{}] * dist.get_world_size()
    dist.all_gather_object(every, digests)
    keys = dict.fromkeys(key for theirs in every for key in theirs)
    holders: dict[Key, dict[str, list[int]]] = {}
    for other, theirs in enumerate(every):
        for key in keys:
            if key in theirs or everywhere:
                holders.setdefault(key, {}).setdefault(theirs.get(key, "absent"), []).append(
                    other)
    differing = sorted((key for key, copies_of in holders.items() if len(copies_of) > 1),
                       key=lambda key: min(min(r) for r in holders[key].values()))
    if not differing:
        return None, 0
    # How much the first one differs: its copies gathered (on this error path only).
    first = differing[0]
    tensors = [None] * dist.get_world_size()
    mine = copies.get(first)
    dist.all_gather_object(tensors, None if mine is None else mine.detach().cpu())
    groups = sorted(holders[first].values(), key=min)
    reference = groups[0][0]
    ranks = sorted(r for group in groups[1:] for r in group)
    difference = max(_max_abs(tensors[r], tensors[reference]) for r in ranks)
    return (Disagreement(first[0], ranks, reference, difference),
            len({name for name, _ in differing}))


def _max_abs(copy: torch.Tensor | None, reference: torch.Tensor | None) -> float:
    """The largest difference of two copies; NaN where one holds a NaN the other does not,
    infinite where one is absent or of another shape."""
    if copy is None or reference is None or copy.shape != reference.shape:
        return float("inf")
    if not copy.is_floating_point():
        return float((copy.long() - reference.long()).abs().max()) if copy.numel() else 0.0
    difference = (copy.double() - reference.double()).abs()
    both_nan = copy.isnan() & reference.isnan()
    difference = difference.masked_fill(both_nan, 0.0)
    return float(difference.max()) if difference.numel() else 0.0

