"""A diagnosis of a sharded model across the ranks of ``torchrun``: against a trace of the
model recorded in one process (``diagnose ENTRY --nproc N --against TRACE``, how a sharding bug
is found), or against another model sharded alike (``diagnose A B --nproc N``, for models no
process holds whole).

Every rank runs B, the factory's model sharded by its own plan, forward on A's inputs with a
hook on each module: an output that is a DTensor is gathered whole, a plain tensor is the
rank's own value. Rank 0 gathers every rank's values and judges each module's output, with the
budget a propagated error gets, in the order the calls finished (children before parents): the
first module whose output leaves its budget on some rank, or whose copies differ between ranks,
is the first divergence, said with the ranks where it shows. Ranks that run a replicated module
on the same inputs compute the same bits, so a copy that differs at all (a replicated norm
whose weights drifted on one rank) is a divergence, however small, and names the ranks that
differ from rank 0.

Against a trace, each rank's output is judged against A's recorded whole one; where every rank
holds a plain slice of it along one dimension (a column-parallel output kept local), the slices
joined in rank order are judged, and outputs that are neither are not judged. Against a model,
A and its float64 golden run sharded by A's plan, and each rank's output of B is judged against
that rank's of A and of the golden: the plans must shard alike, and a call whose outputs differ
in shape between A and B is not judged.

Local errors (module replays) are not computed across ranks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchparity.diagnosis.capture import call_key
from torchparity.diagnosis.capture_a import open_reference
from torchparity.diagnosis.judging import judge_quickly, module_padding
from torchparity.diagnosis.reference import Reference
from torchparity.diagnosis.results import Result, module_label
from torchparity.diagnosis.run import GOLDEN_DTYPE
from torchparity.diagnosis.trace import check_recorded_inputs
from torchparity.subject import Subject, sharded
from torchparity.subject.padding import Padding
from torchparity.subject.running import call_model, cast_inputs
from torchparity.subject.trees import flatten_tensors, map_tensors
from torchparity.text import wrap

#: One call's output tensors by path.
Tensors = dict[str, torch.Tensor]
#: One rank's module outputs: call key -> output path -> tensor.
Outputs = dict[str, Tensors]


@dataclass
class RankDivergence:
    """The first module whose output leaves its budget, the ranks where it does, and the
    verdict of the first of them."""

    module: str
    module_type: str
    ranks: list[int]
    result: Result


@dataclass
class RankReport:
    """What rank 0 found against A (``against`` says what it is): the first divergence
    (None: none) over ``judged`` modules."""

    against: str
    nproc: int
    judged: int
    first_divergence: RankDivergence | None

    @property
    def exit_status(self) -> int:
        return 0 if self.first_divergence is None else 1

    def lines(self) -> list[str]:
        first = self.first_divergence
        if first is None:
            return [*wrap(f"No module diverges on any of {self.nproc} ranks ({self.judged} "
                          f"modules judged against {self.against})."), LOCAL_NOT_COMPUTED]
        ranks = ", ".join(map(str, first.ranks))
        return [*wrap(f"First divergence: {module_label(first.module)} ({first.module_type}) "
                      f"on rank{'s' if len(first.ranks) > 1 else ''} {ranks} of {self.nproc}"),
                *wrap(f"  {first.result.explain()}"), LOCAL_NOT_COMPUTED]

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {"against": self.against, "nproc": self.nproc, "judged_modules": self.judged,
                "first_divergence": None if first is None else {
                    "module": first.module, "module_type": first.module_type,
                    "ranks": first.ranks, "result": first.result.to_dict()},
                "local_errors": "not computed under --nproc"}


LOCAL_NOT_COMPUTED = "Local errors are not computed across ranks (--nproc)."


@dataclass
class RanksDiffer:
    """A verdict (:class:`~torchparity.diagnosis.results.Result`): the copies of a module's
    output that every rank computes differ between ranks."""

    ranks: list[int]
    difference: float

    ok = False
    verdict = "differs between ranks"

    def explain(self) -> str:
        return (f"differs between ranks: the output of rank(s) {', '.join(map(str, self.ranks))}"
                f" differs from rank 0's by up to {self.difference:.3g} (max-abs), though every "
                "rank runs the same replicated computation on the same inputs")

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "ok": False, "ranks": self.ranks,
                "max_abs_difference": self.difference}


def diagnose_across_ranks(trace: Path, subject: Subject) -> RankReport | None:
    """Run ``subject`` sharded on every rank against ``trace``; rank 0's report (None on the
    other ranks). Every rank must call it."""
    reference, meta = open_reference(trace)
    check_recorded_inputs(trace, subject.inputs, meta.inputs_digest, "inputs")
    dtype = getattr(torch, meta.dtype) if meta.dtype else _dtype_of(subject)
    outputs, _ = _sharded_outputs(subject, dtype, subject.inputs, "the diagnosed model")
    everyone = _at_rank_zero(outputs)
    if everyone is None:
        return None
    judged, first = _first_divergence(_against_trace(reference, everyone))
    return RankReport(str(trace), len(everyone), judged, first)


def diagnose_pair_across_ranks(subject_a: Subject, subject_b: Subject, entry_a: str
                               ) -> RankReport | None:
    """Run A (``subject_a``, its float64 golden too) and B sharded by their plans on every
    rank, both on A's inputs; rank 0's report (None on the other ranks). Every rank must call
    it. Each rank's module outputs of B are judged against its own of A and the golden, so
    the plans must shard the models alike."""
    a_dtype = _dtype_of(subject_a)
    a_outputs, calls = _sharded_outputs(subject_a, a_dtype, subject_a.inputs, "A")
    golden, _ = _sharded_outputs(subject_a, GOLDEN_DTYPE, subject_a.inputs, "A's golden")
    b_outputs, _ = _sharded_outputs(subject_b, _dtype_of(subject_b), subject_a.inputs, "B")
    everyone = _at_rank_zero((a_outputs, golden, b_outputs))
    if everyone is None:
        return None
    a_ranks, golden_ranks, b_ranks = (list(side) for side in zip(*everyone, strict=True))
    judged, first = _first_divergence(_against_a(calls, a_ranks, golden_ranks, b_ranks,
                                                 subject_a.padding))
    return RankReport(f"{entry_a} run sharded alike", len(everyone), judged, first)


def _dtype_of(subject: Subject) -> torch.dtype:
    return next((p.dtype for p in subject.model.parameters()), torch.float32)


def _sharded_outputs(subject: Subject, dtype: torch.dtype, inputs: Any, label: str
                     ) -> tuple[Outputs, dict[str, tuple[str, str]]]:
    """``subject`` in ``dtype``, sharded by its plan, run on ``inputs``: each module call's
    outputs (:func:`_module_outputs`), and each call's module name and type in the order the
    calls finished."""
    device = sharded.device_type()
    sharded.mark(f"the sharding of {label} (the factory's plan)")
    model, _ = sharded.placed(subject, device, dtype)
    sharded.mark(f"the forward of {label}")
    return _module_outputs(model, cast_inputs(inputs, device, dtype))


def _at_rank_zero(value: Any) -> list[Any] | None:
    """Every rank's ``value`` in rank order on rank 0; None on the other ranks."""
    import torch.distributed as dist

    everyone = [None] * sharded.world_size() if sharded.rank() == 0 else None
    dist.gather_object(value, everyone, dst=0)
    return everyone


def _module_outputs(model: torch.nn.Module, inputs: Any
                    ) -> tuple[Outputs, dict[str, tuple[str, str]]]:
    """Each module call's outputs, DTensors gathered whole, on the CPU, by call key; and
    each call's module name and type, in the order the calls finished."""
    outputs: Outputs = {}
    calls: dict[str, tuple[str, str]] = {}
    counts: dict[str, int] = {}

    def keep(name: str):
        def hook(module, args, output) -> None:
            key = call_key(name, counts.get(name, 0))
            counts[name] = counts.get(name, 0) + 1
            whole = map_tensors(output, lambda t: sharded.whole(t).detach().cpu())
            outputs[key] = flatten_tensors(whole)
            calls[key] = (name, type(module).__name__)
        return hook

    handles = [module.register_forward_hook(keep(name)) for name, module in model.named_modules()]
    try:
        with torch.no_grad():
            call_model(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return outputs, calls


@dataclass
class _Judged:
    """One module call judged on every rank: B's verdict per rank, and B's copies of an
    output every rank must compute bit for bit alike (None: not a replicated output)."""

    module: str
    module_type: str
    results: list[Result]
    copies: list[Tensors] | None


def _first_divergence(judged: Iterator[_Judged]) -> tuple[int, RankDivergence | None]:
    """How many calls were judged, and the first (in finishing order) that diverges on some
    rank, or whose replicated copies differ between ranks."""
    count = 0
    for call in judged:
        count += 1
        diverged = [rank for rank, result in enumerate(call.results) if not result.ok]
        if diverged:
            return count, RankDivergence(call.module, call.module_type, diverged,
                                         call.results[diverged[0]])
        differ = None if call.copies is None else _ranks_differ(call.copies)
        if differ is not None:
            return count, RankDivergence(call.module, call.module_type, differ.ranks, differ)
    return count, None


def _against_trace(reference: Reference, everyone: list[Outputs]) -> Iterator[_Judged]:
    """Each of A's recorded calls that every rank made, B's outputs as A's whole ones
    (:func:`_as_a_sees_them`) judged against the trace's, with its budgets."""
    for a in sorted(reference.calls, key=lambda call: call.order):
        if not all(a.key in ranks for ranks in everyone):
            continue
        candidates = _as_a_sees_them([ranks[a.key] for ranks in everyone], a.output_shapes)
        if candidates:
            yield _Judged(a.name, a.module_type,
                          [reference.judge((a,), c, "out", "golden_out", "forward", quick=True)
                           for c in candidates], candidates)


def _against_a(calls: dict[str, tuple[str, str]], a_ranks: list[Outputs],
               golden_ranks: list[Outputs], b_ranks: list[Outputs], padding: Padding
               ) -> Iterator[_Judged]:
    """Each call of A that every rank of B made, each rank's B judged against that rank's A
    and golden in one layout (:func:`_in_one_layout`); an output whose copies are alike on
    every rank of A is one B must compute alike too."""
    for key, (name, module_type) in calls.items():
        parts = [(a.get(key), g.get(key), b.get(key))
                 for a, g, b in zip(a_ranks, golden_ranks, b_ranks, strict=True)]
        if any(side is None for sides in parts for side in sides):
            continue
        sides = _in_one_layout(*(list(side) for side in zip(*parts, strict=True)))
        if sides is None:
            continue
        spec = module_padding(padding, name)
        results = [judge_quickly(b, g, a, "forward", spec) for a, g, b in sides]
        replicated = _ranks_differ([a for a, _, _ in sides]) is None
        yield _Judged(name, module_type, results,
                      [b for _, _, b in sides] if replicated else None)


#: One rank's A, golden and B outputs of one call.
Sides = tuple[Tensors, Tensors, Tensors]


def _in_one_layout(a_parts: list[Tensors], golden_parts: list[Tensors], b_parts: list[Tensors]
                   ) -> list[Sides] | None:
    """Per rank, A's, the golden's and B's output tensors of one call in one layout: as they
    are where each rank's A and B have one shape; where one side holds slices of the other's
    whole along one dimension (one plan keeps a column-parallel output local, the other
    gathers it), those slices joined in rank order. None where a tensor fits neither."""
    if any(a.keys() != b.keys() for a, b in zip(a_parts, b_parts, strict=True)):
        return None
    sides: list[Sides] = [({}, {}, {}) for _ in a_parts]
    for path in a_parts[0]:
        a, g, b = ([part[path] for part in parts] for parts in (a_parts, golden_parts, b_parts))
        if all(x.shape == y.shape for x, y in zip(a, b, strict=True)):
            found = list(zip(a, g, b, strict=True))
        elif (whole := _joined(b, tuple(a[0].shape))) is not None:
            found = [(x, y, whole) for x, y in zip(a, g, strict=True)]
        elif (whole_a := _joined(a, tuple(b[0].shape))) is not None and \
                (whole_g := _joined(g, tuple(b[0].shape))) is not None:
            found = [(whole_a, whole_g, y) for y in b]
        else:
            return None
        for side, tensors in zip(sides, found, strict=True):
            for held, tensor in zip(side, tensors, strict=True):
                held[path] = tensor
    return sides


def _ranks_differ(candidates: list[Tensors]) -> RanksDiffer | None:
    """The ranks whose output differs in any bit from rank 0's, and by how much; None when
    every rank's equals it."""
    first = candidates[0]
    differences = {rank: max(float((t.double() - first[p].double()).abs().max())
                             for p, t in c.items())
                   for rank, c in enumerate(candidates[1:], start=1)
                   if any(not torch.equal(t, first[p]) for p, t in c.items())}
    if not differences:
        return None
    return RanksDiffer(sorted(differences), max(differences.values()))


def _as_a_sees_them(parts: list[Tensors], shapes: dict[str, tuple[int, ...]]
                    ) -> list[Tensors]:
    """Each rank's output tensors that stand for A's: those of A's shape as they are, and
    slices of A's along one dimension joined in rank order (the same for every rank); empty
    when none does."""
    candidates: list[Tensors] = [{} for _ in parts]
    for path, shape in shapes.items():
        tensors = [rank.get(path) for rank in parts]
        if any(t is None for t in tensors):
            continue
        if all(tuple(t.shape) == tuple(shape) for t in tensors):
            for candidate, tensor in zip(candidates, tensors, strict=True):
                candidate[path] = tensor
            continue
        joined = _joined(tensors, tuple(shape))
        if joined is not None:
            for candidate in candidates:
                candidate[path] = joined
    return candidates if candidates[0] else []


def _joined(tensors: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor | None:
    """``tensors`` joined along the one dimension where they are slices of ``shape``."""
    first = tensors[0]
    if first.dim() != len(shape):
        return None
    differing = [d for d in range(first.dim()) if first.shape[d] != shape[d]]
    if len(differing) != 1:
        return None
    dim = differing[0]
    if any(t.shape[:dim] + t.shape[dim + 1:] != first.shape[:dim] + first.shape[dim + 1:]
           for t in tensors) or sum(t.shape[dim] for t in tensors) != shape[dim]:
        return None
    return torch.cat(tensors, dim=dim)
