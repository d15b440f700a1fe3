"""A diagnosis of a sharded model across the ranks of ``torchrun``, against a trace of the
model recorded in one process (``diagnose ENTRY --nproc N --against TRACE``).

Every rank runs B, the factory's model sharded by its own plan, forward on the trace's inputs
with a hook on each module: an output that is a DTensor is gathered whole, a plain tensor is
the rank's own value. Rank 0 gathers every rank's values and judges each module's output
against A's recorded one, with the budget a propagated error gets, in the order the calls
finished (children before parents): the first module whose output leaves its budget on some
rank, or whose copies differ between ranks, is the first divergence, said with the ranks where
it shows. Ranks that run a replicated module on the same inputs compute the same bits, so a
copy that differs at all (a replicated norm whose weights drifted on one rank) is a divergence,
however small, and names the ranks that differ from rank 0. Where every rank holds a
plain slice of A's output along one dimension (a column-parallel output kept local), the
slices joined in rank order are judged; outputs that are neither are not judged.

Local errors (module replays) are not computed across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchparity.diagnosis.capture import call_key
from torchparity.diagnosis.capture_a import open_reference
from torchparity.diagnosis.reference import Reference
from torchparity.diagnosis.results import Result, module_label
from torchparity.diagnosis.trace import check_recorded_inputs
from torchparity.subject import Subject, sharded
from torchparity.subject.running import call_model
from torchparity.subject.trees import flatten_tensors, map_tensors
from torchparity.text import wrap

#: One rank's module outputs: call key -> output path -> tensor.
Outputs = dict[str, dict[str, torch.Tensor]]


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
    """What rank 0 found: the first divergence (None: none) over ``judged`` modules."""

    trace: str
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
                          f"modules judged against {self.trace})."), LOCAL_NOT_COMPUTED]
        ranks = ", ".join(map(str, first.ranks))
        return [*wrap(f"First divergence: {module_label(first.module)} ({first.module_type}) "
                      f"on rank{'s' if len(first.ranks) > 1 else ''} {ranks} of {self.nproc}"),
                *wrap(f"  {first.result.explain()}"), LOCAL_NOT_COMPUTED]

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {"trace": self.trace, "nproc": self.nproc, "judged_modules": self.judged,
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
    import torch.distributed as dist

    reference, meta = open_reference(trace)
    check_recorded_inputs(trace, subject.inputs, meta.inputs_digest, "inputs")
    dtype = getattr(torch, meta.dtype) if meta.dtype else _dtype_of(subject)
    sharded.mark("the sharding of the diagnosed model (the factory's plan)")
    model, inputs = sharded.placed(subject, sharded.device_type(), dtype)
    sharded.mark("the forward of the diagnosed model")
    outputs = _module_outputs(model, inputs)
    everyone: list[Outputs] | None = [{} for _ in range(sharded.world_size())] \
        if sharded.rank() == 0 else None
    dist.gather_object(outputs, everyone, dst=0)
    if everyone is None:
        return None
    judged, first = _first_divergence(reference, everyone)
    return RankReport(str(trace), len(everyone), judged, first)


def _dtype_of(subject: Subject) -> torch.dtype:
    return next((p.dtype for p in subject.model.parameters()), torch.float32)


def _module_outputs(model: torch.nn.Module, inputs: Any) -> Outputs:
    """Each module call's outputs, DTensors gathered whole, on the CPU, by call key."""
    outputs: Outputs = {}
    calls: dict[str, int] = {}

    def keep(name: str):
        def hook(module, args, output) -> None:
            key = call_key(name, calls.get(name, 0))
            calls[name] = calls.get(name, 0) + 1
            whole = map_tensors(output, lambda t: sharded.whole(t).detach().cpu())
            outputs[key] = flatten_tensors(whole)
        return hook

    handles = [module.register_forward_hook(keep(name)) for name, module in model.named_modules()]
    try:
        with torch.no_grad():
            call_model(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


def _first_divergence(reference: Reference, everyone: list[Outputs]
                      ) -> tuple[int, RankDivergence | None]:
    """How many of A's calls were judged, and the first (in finishing order) that diverges."""
    judged = 0
    for a in sorted(reference.calls, key=lambda call: call.order):
        if not all(a.key in ranks for ranks in everyone):
            continue
        candidates = _as_a_sees_them([ranks[a.key] for ranks in everyone], a.output_shapes)
        if not candidates:
            continue
        judged += 1
        results = [reference.judge((a,), c, "out", "golden_out", "forward", quick=True)
                   for c in candidates]
        diverged = [rank for rank, result in enumerate(results) if not result.ok]
        if diverged:
            return judged, RankDivergence(a.name, a.module_type, diverged, results[diverged[0]])
        differ = _ranks_differ(candidates)
        if differ is not None:
            return judged, RankDivergence(a.name, a.module_type, differ.ranks, differ)
    return judged, None


def _ranks_differ(candidates: list[dict[str, torch.Tensor]]) -> RanksDiffer | None:
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


def _as_a_sees_them(parts: list[dict[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]]
                    ) -> list[dict[str, torch.Tensor]]:
    """Each rank's output tensors that stand for A's: those of A's shape as they are, and
    slices of A's along one dimension joined in rank order (the same for every rank); empty
    when none does."""
    candidates: list[dict[str, torch.Tensor]] = [{} for _ in parts]
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
