"""A model sharded by hand, Megatron-style: column- and row-parallel parameters are plain
tensors, each rank holding one slice along one dimension, partial sums reduced by the model.

Each slice's place (:class:`Slice`) is declared by the factory (``shards={"blocks.0.attn.q.weight":
0}``: rank r holds the r-th equal slice) or found against the model built as one process
(:func:`found_slices`). Then weights and gradients read as one process holds them
(:func:`whole_of`) and a whole one is cut as a rank holds it (:func:`cut`); a parameter found
nowhere is *unmapped*, its gradient not comparable. :func:`under_torchrun` says whether this
process is one of the ranks at all."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from torchparity.errors import UsageError

#: How a factory declares its slices, said where they cannot be found.
DECLARE_HINT = ("declare which dimension each parameter held in slices is split along, "
                'returning shards={"layers.0.attn.q.weight": 0, ...} from the factory')


def under_torchrun() -> bool:
    """Whether this process is one rank of ``torchrun``.

    Returns:
        True where ``RANK`` and ``WORLD_SIZE`` are set (by torchrun or another launcher).
    """
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


@dataclass(frozen=True)
class Slice:
    """This rank's slice of a parameter: ``length`` entries from ``start`` along ``dim`` of
    the one-process parameter, of shape ``whole``."""

    dim: int
    start: int
    length: int
    whole: tuple[int, ...]

    @property
    def offset(self) -> tuple[int, ...]:
        """Where the slice starts in the whole, dimension by dimension."""
        return tuple(self.start if d == self.dim else 0 for d in range(len(self.whole)))


@dataclass
class Slices:
    """The slices of a model sharded by hand: parameter name -> this rank's :class:`Slice`
    (a parameter not named is whole on every rank), and the parameters whose slices were
    found nowhere."""

    held: dict[str, Slice]
    unmapped: list[str]

    def of(self, name: str) -> Slice | None:
        """This rank's slice of parameter ``name``; None for one whole on every rank."""
        return self.held.get(name)


def declared_slices(model: nn.Module, dims: Mapping[str, int], ranks: int, rank: int,
                    label: str) -> Slices:
    """The slices the factory declares (rank ``rank`` holding the ``rank``-th), none unmapped;
    :class:`UsageError` for a name or dimension the model lacks."""
    params = dict(model.named_parameters())
    held = {}
    for name, dim in dims.items():
        if name not in params:
            raise UsageError(f"factory {label} declares shards of {name!r}, which its model "
                             "does not have; name the parameters as named_parameters() does")
        shape = tuple(params[name].shape)
        if not (isinstance(dim, int) and -len(shape) <= dim < len(shape)):
            raise UsageError(f"factory {label} declares {name} (shape {shape}) split along "
                             f"dimension {dim!r}, which it does not have")
        dim %= len(shape)
        whole = shape[:dim] + (shape[dim] * ranks,) + shape[dim + 1:]
        held[name] = Slice(dim, rank * shape[dim], shape[dim], whole)
    return Slices(held, [])


def found_slices(model: nn.Module, one_process: nn.Module) -> Slices:
    """Where each of this rank's parameters lies in its one-process namesake, and those found
    nowhere: by the dimension where they differ and the equal slice it is bit for bit; the ranks
    agree (a collective), so a parameter whose slices do not make the whole is unmapped on all."""
    import torch.distributed as dist

    whole = dict(one_process.named_parameters())
    found: dict[str, Slice | None] = {}
    for name, param in model.named_parameters():
        found[name] = None
        if name not in whole or whole[name].shape == param.shape:
            if name in whole:
                del found[name]
            continue
        found[name] = _located(param.detach(), whole[name].detach())
    everyone: list[dict[str, Slice | None]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, found)
    held, unmapped = {}, []
    for name, mine in found.items():
        theirs = [rank.get(name) for rank in everyone]
        if mine is not None and _partition(theirs):
            held[name] = mine
        else:
            unmapped.append(name)
    return Slices(held, unmapped)


def _located(part: torch.Tensor, whole: torch.Tensor) -> Slice | None:
    differ = [d for d in range(whole.ndim) if part.ndim == whole.ndim
              and part.shape[d] != whole.shape[d]]
    if len(differ) != 1 or whole.shape[differ[0]] % part.shape[differ[0]]:
        return None
    dim, length = differ[0], part.shape[differ[0]]
    for start in range(0, whole.shape[dim], length):
        if torch.equal(whole.narrow(dim, start, length), part):
            return Slice(dim, start, length, tuple(whole.shape))
    return None


def _partition(slices: list[Slice | None]) -> bool:
    """Whether the ranks' ``slices`` of one parameter together make its whole, once each."""
    if any(s is None for s in slices):
        return False
    first = slices[0]
    return (all((s.dim, s.length, s.whole) == (first.dim, first.length, first.whole)
                for s in slices)
            and sorted(s.start for s in slices) == list(range(0, first.whole[first.dim],
                                                              first.length)))


def whole_of(tensor: torch.Tensor, where: Slice) -> torch.Tensor:
    """The one-process tensor whose slice ``where`` this rank's ``tensor`` is (a collective)."""
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.detach().contiguous())
    starts: list[int] = [0] * len(parts)
    dist.all_gather_object(starts, where.start)
    ordered = [part for _, part in sorted(zip(starts, parts, strict=True),
                                          key=lambda pair: pair[0])]
    return torch.cat(ordered, dim=where.dim)


def cut(whole: torch.Tensor, where: Slice) -> torch.Tensor:
    """This rank's slice ``where`` of the one-process ``whole``, as a view."""
    return whole.narrow(where.dim, where.start, where.length)


@contextlib.contextmanager
def as_one_process() -> Iterator[None]:
    """The environment of one process (no ``RANK``, ``WORLD_SIZE`` 1) inside the block, so a
    factory builds its one-process model."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ["WORLD_SIZE"], os.environ["LOCAL_WORLD_SIZE"] = "1", "1"
    os.environ["RANK"], os.environ["LOCAL_RANK"] = "0", "0"
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def one_process_model(build: Callable[[], nn.Module]) -> nn.Module:
    """The model ``build`` (the factory) makes as one process."""
    with as_one_process():
        return build()


def part(whole_value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole_value`` as the DTensor ``like`` places it (all of it for a plain
    tensor)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(like, DTensor):
        return whole_value
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh,
                                                          like.placements)
    return whole_value[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
