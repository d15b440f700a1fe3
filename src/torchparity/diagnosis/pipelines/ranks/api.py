"""A diagnosis of a sharded model across the ranks of ``torchrun``: against a trace
recorded in one process (``--nproc N --against TRACE``, how a sharding bug is found), or
against another model sharded alike (``diagnose A B --nproc N``).

Every rank runs B sharded by its plan on A's inputs, keeping each output as it holds it
(``ranks.runs``). The calls every rank made are judged one at a time, children before
parents (``ranks.judging.first_divergence``): each rank makes the call's DTensors whole,
rank 0 gathers and judges them and tells every rank whether to go on, so no rank holds more
than its parts and one call's whole outputs. The first module that leaves its budget on some
rank, or whose copies differ between ranks, is said once by rank 0 (``ranks.report``).

Against a trace an output is judged against A's recorded whole one (plain slices along one
dimension joined in rank order; other layouts not judged); against a model, each rank's B
against that rank's A and golden, sharded by A's plan (the plans must shard alike).
Unless ``backward`` is off, each rank judges its own shards of every parameter gradient
(against a trace: cut from the recorded whole ones); only verdicts are gathered, and a
gradient divergence is reported where the forward has none. No local errors across ranks."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from torchparity.diagnosis.core.run import GOLDEN_DTYPE, default_loss
from torchparity.diagnosis.core.trace import check_recorded_inputs
from torchparity.diagnosis.pipelines.ranks.judging import (
    CallParts,
    GradVerdict,
    Judge,
    first_divergence,
    first_grad_divergence,
    judged_against_a,
    judged_against_trace,
    judged_grads,
    judged_grads_against_trace,
    ranks_differ,
)
from torchparity.diagnosis.pipelines.ranks.report import RankDivergence, RankReport
from torchparity.diagnosis.pipelines.ranks.runs import RankRun, sharded_run, whole_call
from torchparity.diagnosis.stages.capture_a import open_reference
from torchparity.distributed import group
from torchparity.subject import Subject
from torchparity.subject.trees import PyTree, flatten_tensors

T = TypeVar("T")

NO_BACKWARD = "Gradients are not judged (--no-backward)."
PAST_A_DIVERGENCE = ("Gradients are not judged past a forward divergence: each one inherits "
                     "it.")


def diagnose_across_ranks(trace: Path, subject: Subject, *, backward: bool = True
                          ) -> RankReport | None:
    """``subject`` sharded on every rank judged against ``trace`` (backward where the trace has
    gradients); rank 0's report, None elsewhere. Every rank must call it."""
    reference, meta = open_reference(trace)
    check_recorded_inputs(trace, subject.inputs, meta.inputs_digest, "inputs")
    dtype = meta.dtype or _dtype_of(subject)
    with_grads = backward and meta.backward

    def loss(output: PyTree, inputs: PyTree) -> torch.Tensor:
        if subject.loss_fn is not None:
            return subject.loss_fn(output, inputs)
        return default_loss(output, inputs, reference.padding)

    run = sharded_run(subject, dtype, subject.inputs, "the diagnosed model",
                      loss if with_grads else None)
    grads = _grad_divergence(judged_grads_against_trace(reference, run), run) \
        if with_grads else None
    recorded = {a.key: a for a in sorted(reference.calls, key=lambda call: call.order)}
    judged, first = _streamed([key for key in recorded if key in run.outputs],
                              lambda key: whole_call(run.outputs[key]),
                              lambda key, parts: judged_against_trace(reference, recorded[key],
                                                                      parts))
    if group.rank() != 0:
        return None
    report = RankReport(str(trace), group.world_size(), judged, first)
    _say_grads(report, grads, NO_BACKWARD if not backward else None if meta.backward else
               f"Gradients are not judged: trace {trace} has none (recorded with "
               "--no-backward).")
    return report


def diagnose_pair_across_ranks(subject_a: Subject, subject_b: Subject, entry_a: str, *,
                               backward: bool = True) -> RankReport | None:
    """A (with its float64 golden) and B sharded by their plans on A's inputs, judged on every
    rank; rank 0's report, None elsewhere. Every rank must call it."""
    inputs = subject_a.inputs

    def loss(output: PyTree, cast: PyTree) -> torch.Tensor | str:
        return subject_a.loss(output, cast, flatten_tensors(output))

    def run(subject: Subject, dtype: torch.dtype, label: str) -> RankRun:
        return sharded_run(subject, dtype, inputs, label, loss if backward else None)

    a = run(subject_a, _dtype_of(subject_a), "A")
    golden = run(subject_a, GOLDEN_DTYPE, "A's golden")
    b = run(subject_b, _dtype_of(subject_b), "B")
    grads = _grad_divergence(judged_grads(a, golden, b), b) if backward else None
    judged, first = _streamed(
        [key for key in a.calls if key in golden.outputs and key in b.outputs],
        lambda key: tuple(whole_call(side.outputs[key]) for side in (a, golden, b)),
        lambda key, parts: judged_against_a(*a.calls[key], parts, subject_a.padding))
    if group.rank() != 0:
        return None
    report = RankReport(f"{entry_a} run sharded alike", group.world_size(), judged, first)
    no_grads = a.no_grads or b.no_grads
    _say_grads(report, grads, NO_BACKWARD if not backward else
               f"Gradients are not judged: {no_grads}." if no_grads else None)
    return report


def _say_grads(report: RankReport, grads: tuple[int, RankDivergence | None] | None,
               why_not: str | None) -> None:
    """The gradients' part of ``report``: ``why_not`` they were not judged, else their
    verdict, which stands only where the forward has no divergence."""
    if why_not is not None:
        report.grad_note = why_not
    elif report.first_divergence is not None:
        report.grad_note = PAST_A_DIVERGENCE
    else:
        report.grads_judged, report.first_grad_divergence = grads


def _streamed(keys: list[str], held: Callable[[str], CallParts], judge: Judge
              ) -> tuple[int, RankDivergence | None]:
    """The first divergence over the calls of ``keys`` that every rank made, judged one at a
    time on rank 0. Every rank must call it."""
    return first_divergence(_agreed(keys), held, judge, _at_rank_zero, _said_by_rank_zero)


def _agreed(keys: list[str]) -> list[str]:
    """Rank 0's ``keys`` that every rank has too, in rank 0's order: the same list on every
    rank, so that every rank makes the same collectives in the same order."""
    import torch.distributed as dist

    everyone: list[list[str] | None] = [None] * group.world_size()
    dist.all_gather_object(everyone, keys)
    others = [set(rank) for rank in everyone[1:]]
    return [key for key in everyone[0] if all(key in rank for rank in others)]


def _said_by_rank_zero(value: T) -> T:
    """Rank 0's ``value`` (a small object), on every rank."""
    import torch.distributed as dist

    said = [value]
    dist.broadcast_object_list(said, src=0)
    return said[0]


def _grad_divergence(verdicts: list[GradVerdict], b: RankRun
                     ) -> tuple[int, RankDivergence | None] | None:
    """On rank 0, how many modules' gradients were judged and the first that diverges (None
    elsewhere). Every rank must call it: gradients whose copies disagree are gathered."""
    everyone = _at_rank_zero(verdicts)
    found = None if everyone is None else first_grad_divergence(everyone)
    flagged = _said_by_rank_zero(None if found is None else found[2])
    copies = None if flagged is None else _at_rank_zero(b.grads[flagged])
    if found is None:
        return None
    judged, first, module = found
    if module is not None:
        differ = ranks_differ(copies, "gradient")
        first = RankDivergence(module, b.module_type(module), differ.ranks, differ)
    return judged, first


def _dtype_of(subject: Subject) -> torch.dtype:
    return next((p.dtype for p in subject.model.parameters()), torch.float32)


def _at_rank_zero(value: T) -> list[T] | None:
    """Every rank's ``value`` in rank order on rank 0; None on the other ranks."""
    import torch.distributed as dist

    everyone = [None] * group.world_size() if group.rank() == 0 else None
    dist.gather_object(value, everyone, dst=0)
    return everyone
