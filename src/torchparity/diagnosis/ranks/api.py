"""A diagnosis of a sharded model across the ranks of ``torchrun``: against a trace of the
model recorded in one process (``diagnose ENTRY --nproc N --against TRACE``, how a sharding bug
is found), or against another model sharded alike (``diagnose A B --nproc N``, for models no
process holds whole).

Every rank runs B, the factory's model sharded by its own plan, forward on A's inputs with a
hook on each module (:mod:`~torchparity.diagnosis.ranks.runs`). Rank 0 gathers every rank's
module outputs and judges them (:mod:`~torchparity.diagnosis.ranks.judging`) in the order the
calls finished (children before parents): the first module whose output leaves its budget on
some rank, or whose copies differ between ranks, is the first divergence, said once with the
ranks where it shows (:mod:`~torchparity.diagnosis.ranks.report`).

Against a trace, each rank's output is judged against A's recorded whole one; where every rank
holds a plain slice of it along one dimension (a column-parallel output kept local), the slices
joined in rank order are judged, and outputs that are neither are not judged. Against a model,
A and its float64 golden run sharded by A's plan, and each rank's output of B is judged against
that rank's of A and of the golden: the plans must shard alike (where one keeps a column's
slices local and the other gathers them, the slices are joined), and a call whose outputs fit
neither layout is not judged.

Unless ``backward`` is off, B (and A and the golden, against a model) also runs backward from
A's loss, and each rank judges its own shards of each module's parameter gradients against its
shards of A's and the golden's (against a trace: cut from the recorded whole ones as B's are
cut): no gradient is gathered, only the verdicts are. A gradient divergence is reported where
the forward has none (past one, every gradient inherits it).

Local errors (module replays) are not computed across ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from torchparity.diagnosis.capture_a import open_reference
from torchparity.diagnosis.ranks.judging import (
    GradVerdict,
    against_a,
    against_trace,
    first_divergence,
    first_grad_divergence,
    judged_grads,
    judged_grads_against_trace,
    ranks_differ,
)
from torchparity.diagnosis.ranks.report import RankDivergence, RankReport
from torchparity.diagnosis.ranks.runs import RankRun, sharded_run
from torchparity.diagnosis.run import GOLDEN_DTYPE, default_loss
from torchparity.diagnosis.trace import check_recorded_inputs
from torchparity.subject import Subject, sharded
from torchparity.subject.trees import flatten_tensors

NO_BACKWARD = "Gradients are not judged (--no-backward)."
PAST_A_DIVERGENCE = ("Gradients are not judged past a forward divergence: each one inherits "
                     "it.")


def diagnose_across_ranks(trace: Path, subject: Subject, *, backward: bool = True
                          ) -> RankReport | None:
    """Run ``subject`` sharded on every rank against ``trace``, forward and, with ``backward``
    where the trace has gradients, backward from the loss the trace's were taken of; rank 0's
    report (None on the other ranks). Every rank must call it."""
    reference, meta = open_reference(trace)
    check_recorded_inputs(trace, subject.inputs, meta.inputs_digest, "inputs")
    dtype = getattr(torch, meta.dtype) if meta.dtype else _dtype_of(subject)
    with_grads = backward and meta.backward

    def loss(output: Any, inputs: Any) -> torch.Tensor:
        if subject.loss_fn is not None:
            return subject.loss_fn(output, inputs)
        return default_loss(output, inputs, reference.padding)

    run = sharded_run(subject, dtype, subject.inputs, "the diagnosed model",
                      loss if with_grads else None)
    grads = _grad_divergence(judged_grads_against_trace(reference, run), run) \
        if with_grads else None
    everyone = _at_rank_zero(run.outputs)
    if everyone is None:
        return None
    judged, first = first_divergence(against_trace(reference, everyone))
    report = RankReport(str(trace), len(everyone), judged, first)
    _say_grads(report, grads, NO_BACKWARD if not backward else None if meta.backward else
               f"Gradients are not judged: trace {trace} has none (recorded with "
               "--no-backward).")
    return report


def diagnose_pair_across_ranks(subject_a: Subject, subject_b: Subject, entry_a: str, *,
                               backward: bool = True) -> RankReport | None:
    """Run A (``subject_a``, its float64 golden too) and B sharded by their plans on every
    rank, both on A's inputs, forward and, with ``backward``, backward from A's loss; rank 0's
    report (None on the other ranks). Every rank must call it."""
    inputs = subject_a.inputs

    def loss(output: Any, cast: Any) -> torch.Tensor | str:
        return subject_a.loss(output, cast, flatten_tensors(output))

    def run(subject: Subject, dtype: torch.dtype, label: str) -> RankRun:
        return sharded_run(subject, dtype, inputs, label, loss if backward else None)

    a = run(subject_a, _dtype_of(subject_a), "A")
    golden = run(subject_a, GOLDEN_DTYPE, "A's golden")
    b = run(subject_b, _dtype_of(subject_b), "B")
    grads = _grad_divergence(judged_grads(a, golden, b), b) if backward else None
    everyone = _at_rank_zero((a.outputs, golden.outputs, b.outputs))
    if everyone is None:
        return None
    a_ranks, golden_ranks, b_ranks = (list(side) for side in zip(*everyone, strict=True))
    judged, first = first_divergence(against_a(a.calls, a_ranks, golden_ranks, b_ranks,
                                               subject_a.padding))
    report = RankReport(f"{entry_a} run sharded alike", len(everyone), judged, first)
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


def _grad_divergence(verdicts: list[GradVerdict], b: RankRun
                     ) -> tuple[int, RankDivergence | None] | None:
    """On rank 0, how many modules' gradients every rank judged (``verdicts``, this rank's)
    and the first that diverges
    (:func:`~torchparity.diagnosis.ranks.judging.first_grad_divergence`); None on the other
    ranks. Every rank must call it: B's gradients of a module whose copies disagree between
    ranks are gathered to say by how much."""
    import torch.distributed as dist

    everyone = _at_rank_zero(verdicts)
    found = None if everyone is None else first_grad_divergence(everyone)
    flagged = [None if found is None else found[2]]
    dist.broadcast_object_list(flagged, src=0)
    copies = None if flagged[0] is None else _at_rank_zero(b.grads[flagged[0]])
    if found is None:
        return None
    judged, first, module = found
    if module is not None:
        differ = ranks_differ(copies, "gradient")
        first = RankDivergence(module, b.module_type(module), differ.ranks, differ)
    return judged, first


def _dtype_of(subject: Subject) -> torch.dtype:
    return next((p.dtype for p in subject.model.parameters()), torch.float32)


def _at_rank_zero(value: Any) -> list[Any] | None:
    """Every rank's ``value`` in rank order on rank 0; None on the other ranks."""
    import torch.distributed as dist

    everyone = [None] * sharded.world_size() if sharded.rank() == 0 else None
    dist.gather_object(value, everyone, dst=0)
    return everyone
