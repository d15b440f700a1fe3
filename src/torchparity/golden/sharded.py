"""Goldens and checks of a user's model sharded over the ranks of ``torchrun``.

``golden update --model ENTRY --nproc N`` and ``check --model ENTRY --nproc N`` start the same
command as N ranks (:func:`torchparity.distributed.ranks.start`); inside a user's own
``torchrun ... -m torchparity ...`` the command finds itself a rank and runs as one.

Every rank loads the factory, whose plan shards its model before the first run. The float64
golden is computed by that sharded model itself, cast module by module as the 1B path of one
process does (:class:`~torchparity.subject.blockwise.Float64Run`): a rank holds its part of the
model in the model's dtype and the running module's part in float64, never the whole model.
The cells of the model's own dtype run it as it is, as in one process; a cell of another dtype
makes a copy in its dtype sharded alike, each rank only its part
(:func:`~torchparity.subject.sharding.placed`).
A big gradient held in parts by the ranks is sketched from runs of it assembled across them
(:func:`kept_across_ranks`), never whole on a rank; outputs and small gradients that are
DTensors are gathered one at a time, each kept before the next. The kept tensors are bit for
bit what one process keeps of the same values, so the goldens on disk do not depend on the
number of ranks: made with 2, they check with 1 or 4. Every rank judges
alike; rank 0 alone writes and prints. The differences sharding makes (reductions split across
ranks) are in the baseline, which runs sharded as the cell does, and so in every budget.

A model that generates decodes on every rank as in one process, each step's outputs gathered
whole before the next token is chosen: the reference cell greedily (or by its search), every
other cell along the golden's tokens. A compiled cell (``--compile``) compiles its own sharded
copy on every rank, as one process compiles a model of its own.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from torchparity.distributed import agreement, group, sharding
from torchparity.distributed.ranks import collectively
from torchparity.dtypes import DTYPES
from torchparity.errors import BackendUnavailable, UsageError
from torchparity.golden import check_loop
from torchparity.golden.cells import REFERENCE, Cell, CellRun, CheckResult, matmul_precision
from torchparity.golden.model_check import ModelFeed
from torchparity.golden.model_runs import (
    OUTPUT_KINDS,
    attention_backend,
    cell_attention,
    decode_into,
    forward_backward,
    perturb_stretch,
    perturbation,
)
from torchparity.golden.renamed import state_layout
from torchparity.golden.store import GoldenStore
from torchparity.golden.user_models import model_checksums, write_goldens
from torchparity.sketching import CHUNK, Sketch, kept, sketch_chunks, wants_sketch
from torchparity.subject import Subject
from torchparity.subject.blockwise import Float64Run, stream_grads
from torchparity.subject.compiling import compiled
from torchparity.subject.decoding import Fed
from torchparity.subject.islands import Islands
from torchparity.subject.running import cast_inputs, local_part, on_meta
from torchparity.subject.slices import DECLARE_HINT, Slice, Slices, under_torchrun, whole_of
from torchparity.subject.trees import map_tensors


def active() -> bool:
    """Whether this process is one rank of a sharded run.

    Returns:
        True under torchrun.
    """
    return under_torchrun()


def run_sharded(subject: Subject, cell: Cell, loss_paths: list[str] | None, *,
                perturb: bool = False, tokens: Fed | None = None) -> CellRun:
    """``subject`` run in ``cell`` by every rank, no rank holding the whole model.

    In float64, the factory's sharded model itself is cast module by module
    (:class:`~torchparity.subject.blockwise.Float64Run`: a rank holds its part in the model's
    dtype and one module's part in float64); in the model's own dtype, that model as it is;
    else a copy in the cell's dtype sharded by the factory's plan. Outputs and gradients are
    kept one by one as the backward completes each; a model that generates then decodes.

    Args:
        subject: the user's model, sharded (:func:`~torchparity.distributed.sharding.hold`).
        cell: the cell.
        loss_paths: the outputs the default loss projects (None: all floating ones).
        perturb: float64 cells: weights moved by one float64 rounding.
        tokens: what a step-by-step decoding is fed (None: its own choices).

    Returns:
        The run, its tensors as one process would keep them.
    """
    run_name = f"the {cell.label} run" + (" (perturbed)" if perturb else "")

    def agreed_run() -> CellRun:
        run = _run_sharded(subject, cell, loss_paths, run_name, perturb=perturb, tokens=tokens)
        agreement.check_kept(run.outputs, run_name)  # every rank judges it alike, or none does
        return run

    return collectively(run_name, agreed_run)


def replicas_agree(subject: Subject) -> None:
    """Fail on every rank alike when a weight the ranks hold replicated differs between them
    (:func:`~torchparity.distributed.agreement.check_replicated`), once the factory's model is
    sharded and before any rank judges anything.

    Args:
        subject: the user's model.

    Raises:
        RanksDisagree: a replicated weight differs, naming it, the ranks and by how much.
    """
    def compared() -> None:
        sharding.hold(subject)
        group.mark("the comparison of the replicated weights")
        agreement.check_replicated(subject.shards, subject.slices)

    collectively("the comparison of the replicated weights", compared)


def _weighed(subject: Subject) -> Subject:
    """``subject``, held (:func:`~torchparity.subject.sharding.hold`) when its factory built it
    on the meta device, or sharded it itself: its weights exist only in parts, and their
    checksums are then gathered one tensor at a time. A model built whole is weighed before
    its plan runs, since a plan may change weights (a drifted copy is a difference to find,
    not another init)."""
    if on_meta(subject.model) or subject.parallelize is None:
        sharding.hold(subject)
        group.mark("the checksums of the weights")
    return subject


def _run_sharded(subject: Subject, cell: Cell, loss_paths: list[str] | None, run_name: str,
                 *, perturb: bool, tokens: Fed | None) -> CellRun:
    attention = cell_attention(subject, cell.backend)
    group.mark(f"the sharding of {run_name} (the factory's plan)")
    grads: dict[str, Any] = {}
    float64 = None
    if _runs_held(subject, cell):
        model = sharding.held(subject, attention)
        inputs = cast_inputs(subject.inputs, cell.device, DTYPES[cell.dtype])
        if cell.dtype == "fp64":
            moved = functools.partial(perturbation_in_parts, held=subject.slices)
            float64 = Float64Run(model, on_grad=_gathered_into(grads, subject.slices),
                                 device=cell.device, perturb=moved if perturb else None)
    else:
        model, inputs = sharding.placed(subject, cell.device, DTYPES[cell.dtype], attention)
    group.mark(f"the forward and backward of {run_name}")

    def gathered_grads(loss: torch.Tensor) -> dict[str, Any]:
        if float64 is None:
            stream_grads(model, loss, _gathered_into(grads, subject.slices), unused=False)
        else:
            float64.backward(loss, unused=False)
        return grads

    # A float64 run notes where the model computes in a narrower dtype, as one process does.
    islands = Islands(model) if float64 is not None else None
    try:  # every rank meets the same unavailable backend, before any collective
        with compiled(model, cell.compile) as compile_log, \
                attention_backend(cell.backend) as intercepted, matmul_precision(cell.dtype), \
                float64 or contextlib.nullcontext(), islands or contextlib.nullcontext(), \
                outputs_whole(model):
            run = forward_backward(subject, model, inputs, loss_paths, gathered_grads)
            run.compile_log = compile_log
            sharding.gather_root(model)
            decode_into(subject, model, inputs, run, tokens)
    except BackendUnavailable as exc:
        return CellRun({}, dict.fromkeys(OUTPUT_KINDS, str(exc)))
    finally:
        sharding.reshard(model)
    if subject.slices is not None and subject.slices.unmapped:
        run.outputs.pop("grads", None)
        run.missing["grads"] = unmapped_reason(subject.slices)
    if islands is not None:
        run.islands = islands.found
    run.sdpa_calls = None if intercepted is None else intercepted.calls
    return run


def _runs_held(subject: Subject, cell: Cell) -> bool:
    """Whether ``cell`` runs the factory's sharded model itself, as one process runs the
    factory's model (:class:`~torchparity.golden.model_runs.CellModels`): a float64 cell
    (cast module by module) or one of the model's own dtype, on the kind of device its shards
    are on (its mesh's). Any other cell runs a copy."""
    sharding.hold(subject)
    params = list(subject.shards.parameters())
    device = params[0].device.type if params else "cpu"
    dtypes = {p.dtype for p in params if p.is_floating_point()}
    return not cell.compile and torch.device(cell.device).type == device and (
        cell.dtype == "fp64" or dtypes == {DTYPES[cell.dtype]})


def unmapped_reason(held: Slices) -> str:
    """Why the gradients of a model sharded by hand are not compared, in one line.

    Args:
        held: the slices, some parameters found nowhere.

    Returns:
        The reason, naming a parameter and how to declare its slices.
    """
    names = held.unmapped
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return (f"not compared: the ranks' slices of {names[0]}{more} are found nowhere in the "
            f"weights the factory builds as one process; {DECLARE_HINT}")


def perturbation_in_parts(name: str, value: torch.Tensor, held: Slices | None = None
                          ) -> torch.Tensor:
    """:func:`~torchparity.golden.model_runs.perturbation` of a parameter, whole or in parts.

    Each element is moved as its place in the whole is, so the ranks together move the
    parameter as one process does.

    Args:
        name: the parameter's name.
        value: its float64 value: whole, a DTensor's local part, or a slice.
        held: where a model's slices lie, for a slice.

    Returns:
        The moved value.
    """
    where = held.of(name) if held is not None else None
    if where is not None:
        stretches = sharding.segments(where.whole, tuple(value.shape), where.offset)
    elif sharding.in_parts(value):
        stretches = sharding.stretches(value)
    else:
        return perturbation(name, value)
    flat = local_part(value).view(-1)
    for start, length, part_start in stretches:
        perturb_stretch(name, flat[part_start:part_start + length], start)
    return value


def _gathered_into(grads: dict[str, Any], held: Slices | None
                   ) -> Callable[[str, torch.Tensor], None]:
    """``on_grad(name, grad)`` keeping each gradient in ``grads`` (:func:`kept_across_ranks`)
    before the next one comes; the ranks hand them over in the same order. Of a model
    sharded by hand, a gradient whose slices are found nowhere is not kept."""
    def keep(name: str, grad: torch.Tensor) -> None:
        if held is None or name not in held.unmapped:
            grads[name] = kept_across_ranks(name, grad, held and held.of(name))

    return keep


def kept_across_ranks(name: str, tensor: torch.Tensor, where: Slice | None = None
                      ) -> torch.Tensor | Sketch:
    """``tensor`` as one process keeps it (:func:`~torchparity.sketching.kept`), bit for bit.

    A big one held in parts by the ranks is sketched from runs of it assembled across them
    (:func:`~torchparity.distributed.sharding.flat_chunks`), so that no rank holds it whole;
    any other is gathered whole.

    Args:
        name: the tensor's name, which seeds its sketch.
        tensor: a DTensor, a plain slice, or a tensor every rank holds whole.
        where: where a plain slice lies, joined to the ranks' others.

    Returns:
        The tensor or its sketch, the same on every rank.
    """
    if where is not None:
        return kept(name, whole_of(tensor, where))
    if wants_sketch(tensor) and sharding.in_parts(tensor):
        return sketch_chunks(tuple(tensor.shape), tensor.dtype,
                             sharding.flat_chunks(tensor, CHUNK), name)
    return kept(name, sharding.whole(tensor))


@contextlib.contextmanager
def outputs_whole(model: nn.Module) -> Iterator[None]:
    """``model``'s DTensor outputs gathered as it returns them, inside the block.

    The loss, the judgement and a decoding's choice of the next token see the outputs one
    process would return. A hook, not a wrapper, so that the decoding still finds the model's
    own step (a ``transformers`` model's cache).

    Args:
        model: the sharded model.

    Yields:
        Nothing.
    """
    handle = model.register_forward_hook(
        lambda module, args, output: map_tensors(output, sharding.whole))
    try:
        yield
    finally:
        handle.remove()


class ShardedFeed(ModelFeed):
    """A user's model as the check loop runs it on every rank (see :class:`ModelFeed`)."""

    def run(self, cell: Cell, *, perturb: bool = False) -> CellRun:
        """The model run in ``cell`` by every rank (:func:`run_sharded`; see :meth:`Feed.run`)."""
        group.together(f"the {cell.label} run" + (" (perturbed)" if perturb else ""))
        return run_sharded(self.subject, cell, self.loss_paths, perturb=perturb,
                           tokens=self.fed(cell, perturb))


def check_sharded(subject: Subject, store: GoldenStore, cells: list[Cell],
                  advance: Callable[[str], None] = lambda label: None,
                  status: Callable[[str, str], None] | None = None) -> list[CheckResult]:
    """:func:`~torchparity.golden.model_check.check_subject` on every rank of a sharded run.

    Args:
        subject: the user's model.
        store: its goldens, made in one process.
        cells: the cells.
        advance: called with each cell's label when it is done.
        status: called with ``(label, text)`` while a cell runs.

    Returns:
        One result per cell and output, the same on every rank.
    """
    feed = collectively("the checksums of the weights",
                        lambda: ShardedFeed(_weighed(subject), store, status))
    replicas_agree(feed.subject)
    return check_loop.check_cells(feed, cells, advance)


def write_sharded_goldens(subject: Subject, store: GoldenStore) -> dict[str, str]:
    """The goldens of ``subject`` computed by every rank in float64, written by rank 0.

    Each file is written atomically, none before the whole run succeeded.

    Args:
        subject: the user's model.
        store: where its goldens go.

    Returns:
        What happened to each file, as
        :func:`~torchparity.golden.user_models.write_goldens` says, on every rank.
    """
    import torch.distributed as dist

    checksums = collectively("the checksums of the weights",
                             lambda: model_checksums(_weighed(subject)))
    if subject.slices is not None and subject.slices.unmapped:
        raise UsageError(f"{subject.entry}: no golden can be made of it across ranks: "
                         f"{unmapped_reason(subject.slices).removeprefix('not compared: ')}")
    layout = state_layout(subject.model)  # its names and shapes as the factory made them
    if subject.slices is not None:  # a model sharded by hand: as one process holds it
        layout |= {name: list(where.whole) for name, where in subject.slices.held.items()}
    replicas_agree(subject)
    group.together("the float64 golden run")
    run = run_sharded(subject, REFERENCE, None)
    statuses = [write_goldens(subject, store, run=run, checksums=checksums, layout=layout)
                if group.rank() == 0 else None]
    dist.broadcast_object_list(statuses, src=0)
    return statuses[0]
