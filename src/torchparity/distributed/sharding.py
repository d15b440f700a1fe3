"""A user's model sharded over the ranks of ``torchrun``: by its own plan, or by its factory.

Every rank joins one process group (``.group``) and loads the factory, whose
``parallelize(model, mesh)`` (:func:`shard`) shards it in place over the mesh it asks for
(``{"dp": -1, "tp": 2}``; none: one dimension ``"shard"``), each rank keeping its part
(:func:`hold`). A run's copy in its dtype is planned on the meta device and each rank fills
its own part (:func:`placed`): no rank ever holds the whole model. FSDP2's uneven shards are
read through their real sizes; a tensor-parallel plan splitting a parameter unevenly, or a
head, is refused in one line. A factory with no plan may shard its model itself (DTensors,
or plain slices that ``.slices`` places); a run's copy is then built again (:func:`rebuilt`)."""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from torchparity.distributed.group import mark, rank, world_size
from torchparity.errors import UsageError
from torchparity.subject import hf, slices
from torchparity.subject.factory import call_factory, resolve_entry
from torchparity.subject.running import (
    Inputs,
    cast_inputs,
    converted,
    grad_hooks,
    is_dtensor,
    local_part,
    on_meta,
)

if TYPE_CHECKING:  # importing torch.distributed's mesh module takes seconds
    from torch.distributed.device_mesh import DeviceMesh

    from torchparity.subject.model import Subject

#: The name of the mesh's one dimension when the factory gives none.
DEFAULT_DIMENSION = "shard"


def mesh_sizes(shape: object, ranks: int, label: str) -> dict[str, int]:
    """The factory's ``mesh`` as ``{dimension: size}`` over ``ranks`` (a -1: the ranks left; None:
    one dimension); :class:`UsageError` for a malformed shape or one that does not fit."""
    if shape is None:
        return {DEFAULT_DIMENSION: ranks}
    if not (isinstance(shape, Mapping) and shape and all(
            isinstance(k, str) and isinstance(v, int) for k, v in shape.items())):
        raise UsageError(f"factory {label} returned mesh={shape!r}; give the dimensions by "
                         'name and size, such as {"dp": -1, "tp": 2}')
    sizes = dict(shape)
    unknown = [name for name, size in sizes.items() if size == -1]
    known = math.prod(size for size in sizes.values() if size != -1)
    if len(unknown) > 1 or any(size < 1 and size != -1 for size in sizes.values()):
        raise UsageError(f"factory {label}: mesh {shape} may have one size of -1 and positive "
                         "sizes otherwise")
    if unknown:
        if ranks % known:
            raise UsageError(f"factory {label}: mesh {shape} needs a multiple of {known} ranks; "
                             f"there are {ranks} (--nproc)")
        sizes[unknown[0]] = ranks // known
    if math.prod(sizes.values()) != ranks:
        raise UsageError(f"factory {label}: mesh {shape} holds {math.prod(sizes.values())} "
                         f"ranks; there are {ranks} (--nproc {math.prod(sizes.values())})")
    return sizes


def device_mesh(subject: Subject, device: str | torch.device) -> DeviceMesh:
    """The mesh ``subject``'s factory asks for over every rank, its dimensions named as asked."""
    from torch.distributed.device_mesh import init_device_mesh

    sizes = mesh_sizes(subject.mesh, world_size(), subject.entry)
    return init_device_mesh(torch.device(device).type, tuple(sizes.values()),
                            mesh_dim_names=tuple(sizes))


def shard(subject: Subject, model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``model`` sharded by the factory's ``parallelize(model, mesh)`` (the model it returns, else
    ``model`` in place); :class:`UsageError` for an unfit split, :class:`UserCodeError` when the
    plan raises."""
    plan = subject.parallelize
    returned = subject.guarded(lambda: plan(model, mesh), "its parallelize")
    sharded = returned if isinstance(returned, nn.Module) else model
    refuse_unfit(subject, sharded)
    return sharded


def shards_itself(model: nn.Module) -> bool:
    """Whether the factory returned its model sharded already (some parameters are DTensors)."""
    return any(is_dtensor(param) for param in model.parameters())


def sliced_by_hand(subject: Subject, model: nn.Module) -> slices.Slices:
    """Where the slices of a model sharded by hand lie in the one-process weights: as the factory
    declares (``shards``), else as found; :class:`UsageError` when no rank holds a slice."""
    if subject.split is not None:
        return slices.declared_slices(model, subject.split, world_size(), rank(),
                                      subject.entry)
    one_process = slices.one_process_model(lambda: rebuilt(subject))
    found = slices.found_slices(model, one_process)
    if not (found.held or found.unmapped):
        raise UsageError(f"factory {subject.entry} has no 'parallelize' to shard its model over "
                         f"{world_size()} ranks and did not shard it itself; return "
                         "parallelize(model, mesh) (an FSDP2 or tensor-parallel plan) from it, "
                         "shard it in the factory, or run it in one process")
    return found


def refuse_unfit(subject: Subject, model: nn.Module) -> None:
    """Refuse a tensor-parallel sharding that splits a parameter unevenly or a head."""
    unfit = uneven_shard(model) or split_heads(model)
    if unfit:
        sharding = ("the plan of" if subject.parallelize is not None
                    else "the sharding by factory")
        raise UsageError(f"{sharding} {subject.entry} {unfit}; choose a mesh or --nproc "
                         "that divides it")


def uneven_shard(model: nn.Module) -> str | None:
    """How the first parameter a tensor-parallel plan shards unevenly is split, or None (FSDP2's
    uneven shards are its own, read through their real sizes)."""
    from torch.distributed.tensor import DTensor, Shard

    fsdp = fsdp_mesh_dims(model)
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        names = param.device_mesh.mesh_dim_names or (None,) * param.device_mesh.ndim
        for dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard) and names[dim] not in fsdp.get(id(param), ()):
                ranks = param.device_mesh.size(dim)
                extent = param.shape[placement.dim]
                if extent % ranks:
                    return (f"splits {name} (shape {tuple(param.shape)}) along dimension "
                            f"{placement.dim} over {ranks} ranks, which do not divide {extent}")
    return None


def fsdp_mesh_dims(model: nn.Module) -> dict[int, set[str | None]]:
    """The mesh dimensions (None: unnamed) FSDP2 shards each parameter over, by parameter id."""
    from torch.distributed.fsdp import FSDPModule

    dims: dict[int, set[str | None]] = {}
    for module in model.modules():
        group = module._get_fsdp_state()._fsdp_param_group if isinstance(
            module, FSDPModule) else None
        for fsdp_param in group.fsdp_params if group is not None else ():
            mesh = fsdp_param.mesh_info.mesh
            dims[id(fsdp_param.sharded_param)] = set(mesh.mesh_dim_names or (None,))
    return dims


def split_heads(model: nn.Module) -> str | None:
    """How the first attention module (one with a ``head_dim``) whose heads do not divide among
    the ranks is split, or None."""
    from torch.distributed.tensor import DTensor, Shard

    fsdp = fsdp_mesh_dims(model)  # gathered whole before any computation: heads stay whole
    for module_name, module in model.named_modules():
        head_dim = getattr(module, "head_dim", None)
        if not isinstance(head_dim, int) or head_dim < 1:
            continue
        for name, param in module.named_parameters():
            if not isinstance(param, DTensor):
                continue
            names = param.device_mesh.mesh_dim_names or (None,) * param.device_mesh.ndim
            for dim, placement in enumerate(param.placements):
                tensor_parallel = isinstance(placement, Shard) and names[dim] not in fsdp.get(
                    id(param), ())
                extent = param.shape[placement.dim] if tensor_parallel else 0
                heads, ranks = extent // head_dim, param.device_mesh.size(dim)
                if extent % head_dim == 0 and heads % ranks:
                    return (f"splits the {heads} heads of {module_name} ({head_dim} wide, in "
                            f"{module_name}.{name} of shape {tuple(param.shape)}) over "
                            f"{ranks} ranks")
    return None


class WholeState(Mapping):
    """A sharded model's state dict whose tensors are gathered whole as each is read: every
    rank must read them in the same order. Of a model sharded by hand (``held``: its
    slices), the ranks' slices are joined, and a tensor every rank holds whole is rank 0's
    (a copy that drifted on another rank is a difference to find, not another init)."""

    def __init__(self, state: Mapping[str, torch.Tensor],
                 held: slices.Slices | None = None) -> None:
        self._state, self._held = state, held

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._state[name]
        if self._held is None or is_dtensor(tensor):
            return whole(tensor)
        where = self._held.of(name)
        return slices.whole_of(tensor, where) if where else rank_zeros(tensor)

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


def rank_zeros(tensor: torch.Tensor) -> torch.Tensor:
    """Rank 0's value of ``tensor``, which every rank holds whole, on every rank.

    Args:
        tensor: this rank's copy (a collective: every rank calls it).

    Returns:
        A new tensor with rank 0's values.
    """
    import torch.distributed as dist

    copy_of = tensor.detach().clone()
    dist.broadcast(copy_of, src=0)
    return copy_of


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered into the plain tensor it stands for, on every rank.

    Args:
        tensor: a DTensor (a collective: every rank calls it), or a plain tensor.

    Returns:
        The whole tensor; a plain tensor as it is.
    """
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def flat_chunks(tensor: torch.Tensor, size: int) -> Iterator[torch.Tensor]:
    """The whole flat value of a DTensor in runs of ``size`` elements, never whole on one rank.

    Each rank writes its part's elements of a run (the first rank only along a replicated
    dimension), the others zeros, and the runs' bits are summed as integers over the mesh, so
    -0.0 and NaN payloads survive. ``tensor``'s ranks must hold parts (:func:`in_parts`)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    mesh, placements = tensor.device_mesh, tensor.placements
    coordinate = mesh.get_coordinate()
    writes = all(coordinate[dim] == 0 for dim, placement in enumerate(placements)
                 if not isinstance(placement, Shard))
    bits = _BITS[tensor.element_size()]
    mine = tensor.to_local().detach().reshape(-1).view(bits)
    segments = stretches(tensor) if writes else []
    first = 0  # the first segment that may reach into the run
    for start in range(0, tensor.numel(), size):
        end = min(start + size, tensor.numel())
        run = torch.zeros(end - start, dtype=bits, device=mine.device)
        while first < len(segments) and sum(segments[first][:2]) <= start:
            first += 1
        for whole_start, length, part_start in segments[first:]:
            if whole_start >= end:
                break
            low, high = max(whole_start, start), min(whole_start + length, end)
            run[low - start:high - start] = mine[part_start + low - whole_start:
                                                 part_start + high - whole_start]
        for dim in range(mesh.ndim):
            dist.all_reduce(run, group=mesh.get_group(dim))
        yield run.view(tensor.dtype)


def stretches(tensor: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(start in the whole flat value, length, start in this rank's part)`` of each stretch of
    this rank's part of a DTensor contiguous in the whole."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh,
                                                          tensor.placements)
    return list(segments(tuple(tensor.shape), shape, offset))


def segments(whole: tuple[int, ...], shape: tuple[int, ...], offset: tuple[int, ...]
              ) -> Iterator[tuple[int, int, int]]:
    """``(start in the whole, length, start in the part)`` of each stretch of a part of ``shape``
    at ``offset`` contiguous in ``whole``: one per index before its whole-spanning dimensions."""
    spans = len(whole)
    while spans > 0 and shape[spans - 1] == whole[spans - 1]:
        spans -= 1
    if spans == 0:  # the part spans the whole tensor
        yield 0, math.prod(whole), 0
        return
    strides = torch.empty(whole, device="meta").stride()
    length = math.prod(shape[spans - 1:])
    outer = range(spans - 1)
    for number, index in enumerate(itertools.product(*(range(shape[d]) for d in outer))):
        start = sum((offset[d] + index[d]) * strides[d] for d in outer)
        if length:
            yield start + offset[spans - 1] * strides[spans - 1], length, number * length


#: The integer dtype of each floating element size, whose sum of one value and zeros is exact.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def in_parts(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor whose ranks hold parts, no addend of a pending reduction."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor) and not any(p.is_partial() for p in tensor.placements)


def hold(subject: Subject) -> None:
    """Shard the factory's model once, in its own dtype and device: each rank keeps its part
    (``subject.shards``) and ``subject.model`` becomes its meta-device structure; a meta-built
    model is materialised by the factory's ``init``; a self-sharded one is kept as it is."""
    if subject.shards is not None:
        return
    model = subject.model
    if subject.parallelize is None:  # the factory sharded it: its structure is its own
        mark("the slices of the factory's sharded model")
        if shards_itself(model):
            refuse_unfit(subject, model)
        else:
            subject.slices = sliced_by_hand(subject, model)
        subject.shards = model
        return
    device = "cpu" if on_meta(model) else next(iter(model.parameters()), torch.empty(0)).device
    structure = converted(model, "meta", torch.float64)
    mark("the sharding of the factory's model (its plan)")
    shards = shard(subject, model, device_mesh(subject, device))
    if on_meta(shards):  # built on meta: each rank gets memory for its part only
        subject.materialise(shards, device)
    subject.shards, subject.model = shards, structure


def placed(subject: Subject, device: str | torch.device, dtype: torch.dtype,
           attention: str | None = None) -> tuple[nn.Module, Inputs]:
    """A run's copy of the model in ``dtype`` on ``device``, sharded by the factory's plan on the
    meta device and filled by each rank from its part (:func:`hold`), in eval mode, with the
    inputs cast alike."""
    hold(subject)
    if subject.shards is subject.model:  # sharded by the factory: it shards a copy alike
        model = rebuilt(subject).to(device, dtype)
    else:
        model = converted(subject.model, "meta", dtype)
        if model is subject.model:
            model = copy.deepcopy(model)
        model = shard(subject, model, device_mesh(subject, device))
        _materialised(model, device)
    _fill(model, subject.shards)
    return _ready(subject, model, attention), cast_inputs(subject.inputs, device, dtype)


def rebuilt(subject: Subject) -> nn.Module:
    """The self-sharding factory's model built and sharded anew (FSDP2's modules cannot be
    copied); :func:`placed` fills its parts."""
    factory = resolve_entry(subject.entry)
    return call_factory(factory, subject.entry)["model"]


def held(subject: Subject, attention: str | None = None) -> nn.Module:
    """The factory's sharded model itself in eval mode, no copy made (a float64 run casts it module
    by module)."""
    hold(subject)
    return _ready(subject, subject.shards, attention)


def reshard(model: nn.Module) -> None:
    """Every FSDP2 unit of ``model`` back to its shards.

    A forward with no backward after it (a decoding) leaves the root's parameters gathered
    whole, and the next run's copy is filled from each rank's part (:func:`placed`).

    Args:
        model: a model sharded with FSDP2.
    """
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def gather_root(model: nn.Module) -> None:
    """``model``'s own FSDP2 unit gathered until :func:`reshard`: a decoding step may call a part
    (an encoder) without the forward whose hook gathers the root's parameters."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.unshard()


def _ready(subject: Subject, model: nn.Module, attention: str) -> nn.Module:
    model.eval()
    if subject.is_transformers:
        hf.set_attention(model, attention or subject.attention)
    return model


def _materialised(model: nn.Module, device: str | torch.device) -> None:
    """``model``'s meta parameters and buffers given (empty) storage on ``device``, with the
    gradient hooks the plan put on its parameters: the new parameters would be without them
    (a plan may reduce a gradient in a hook; a copy without it computes something else)."""
    hooks = {name: grad_hooks(p) for name, p in model.named_parameters()}
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        for hook in hooks[name]:
            param.register_hook(hook)


def _fill(model: nn.Module, source: nn.Module) -> None:
    """This rank's part of each parameter and buffer of ``model`` copied from ``source``
    (the same model sharded alike), converted on the way."""
    sources = dict(source.named_parameters()) | dict(source.named_buffers())
    with torch.no_grad():
        for name, param in model.named_parameters():
            local_part(param).copy_(local_part(sources[name]))
        for name, buffer in model.named_buffers():
            local_part(buffer).copy_(local_part(sources[name]))
