"""Judging a diagnosis across ranks: each call's outputs on every rank against A's, one call
at a time as ranks stream them to rank 0, and each rank's parameter-gradient shards against
A's and the golden's, with a propagated error's budgets. Replicated ranks compute the same
bits, so where A's copies agree on every rank, a B copy that differs at all (drifted norm
weights, a gradient reduced on one rank) is a divergence of its own."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from torchparity import digests
from torchparity.comparison.sketch import involves_sketch
from torchparity.diagnosis.core.capture import ModuleCall, call_key
from torchparity.diagnosis.core.judging import judge_quickly, module_padding
from torchparity.diagnosis.core.reference import Reference
from torchparity.diagnosis.core.results import Result
from torchparity.diagnosis.pipelines.ranks.report import RankDivergence, RanksDiffer
from torchparity.diagnosis.pipelines.ranks.runs import RankRun, Tensors
from torchparity.subject.padding import Padding

#: One rank's A, golden and B tensors of one call.
RankTensors = tuple[Tensors, Tensors, Tensors]
#: One rank's tensors of one call: B's (against a trace), or A's, the golden's and B's.
CallParts = Tensors | RankTensors
#: Every rank's parts of one call, in rank order on rank 0; None on the other ranks.
Gather = Callable[[CallParts], "list[CallParts] | None"]
#: One call (its key) judged from every rank's tensors of it; None: not judged.
Judge = Callable[[str, list[CallParts]], "Judged | None"]


@dataclass
class Judged:
    """One call judged on every rank: B's verdict per rank, and B's copies of a replicated
    output."""

    module: str
    module_type: str
    results: list[Result]
    copies: list[Tensors] | None


def first_divergence(keys: list[str], held: Callable[[str], CallParts], judge: Judge,
                     gather: Gather, stop: Callable[[bool], bool]
                     ) -> tuple[int, RankDivergence | None]:
    """How many calls were judged, and the first (in finishing order) that diverges on some rank
    or whose copies differ between ranks, as rank 0 sees them.

    Every rank walks ``keys`` together: each gives its parts of a call (``held``), rank 0
    gathers and judges them, and all stop where rank 0 says; rank 0 holds one call at a time."""
    judged, first = 0, None
    for key in keys:
        was_judged, first = _verdict(key, held, judge, gather, stop)
        judged += was_judged
        if stop(first is not None):
            break
    return judged, first


def _verdict(key: str, held: Callable[[str], CallParts], judge: Judge, gather: Gather,
             stop: Callable[[bool], bool]) -> tuple[bool, RankDivergence | None]:
    """Whether rank 0 judged call ``key``, and its divergence; the call's tensors dropped after."""
    everyone = gather(held(key))
    try:
        call = None if everyone is None else judge(key, everyone)
        return call is not None, None if call is None else _divergence(call)
    except Exception:
        stop(True)  # the other ranks wait for rank 0's word: they stop, rank 0 fails alone
        raise


def _divergence(call: Judged) -> RankDivergence | None:
    """The ranks where ``call`` leaves its budget, else whose replicated copies differ; or None."""
    diverged = [rank for rank, result in enumerate(call.results) if not result.ok]
    if diverged:
        return RankDivergence(call.module, call.module_type, diverged,
                              call.results[diverged[0]])
    differ = None if call.copies is None else ranks_differ(call.copies)
    if differ is not None:
        return RankDivergence(call.module, call.module_type, differ.ranks, differ)
    return None


def judged_against_trace(reference: Reference, a: ModuleCall, parts: list[Tensors]
                         ) -> Judged | None:
    """A's recorded call ``a`` against every rank's B outputs as A's whole ones; None if none
    fits."""
    candidates = _as_a_sees_them(parts, a.output_shapes)
    if not candidates:
        return None
    return Judged(a.name, a.module_type,
                  [reference.judge((a,), c, "out", "golden_out", "forward", quick=True)
                   for c in candidates], candidates)


def judged_against_a(module: str, module_type: str, parts: list[RankTensors], padding: Padding
                     ) -> Judged | None:
    """One call of ``module`` on every rank, each rank's B against its A and golden in one layout
    (None: none fits); an output alike on every rank of A must be alike in B."""
    sides = _in_one_layout(*(list(side) for side in zip(*parts, strict=True)))
    if sides is None:
        return None
    spec = module_padding(padding, module)
    results = [judge_quickly(b, g, a, "forward", spec) for a, g, b in sides]
    replicated = ranks_differ([a for a, _, _ in sides]) is None
    return Judged(module, module_type, results,
                  [b for _, _, b in sides] if replicated else None)


def _in_one_layout(a_parts: list[Tensors], golden_parts: list[Tensors], b_parts: list[Tensors]
                   ) -> list[RankTensors] | None:
    """Per rank, A's, the golden's and B's outputs of one call in one layout: as they are where
    shapes match, or one side's slices joined in rank order; None where a tensor fits neither."""
    if any(a.keys() != b.keys() for a, b in zip(a_parts, b_parts, strict=True)):
        return None
    sides: list[RankTensors] = [({}, {}, {}) for _ in a_parts]
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


def ranks_differ(candidates: list[Tensors], what: str = "output") -> RanksDiffer | None:
    """The ranks whose ``what`` differs in any bit from rank 0's, and by how much; or None."""
    first = candidates[0]
    differences = {rank: max(float((t.double() - first[p].double()).abs().max())
                             for p, t in c.items())
                   for rank, c in enumerate(candidates[1:], start=1)
                   if any(not torch.equal(t, first[p]) for p, t in c.items())}
    if not differences:
        return None
    return RanksDiffer(sorted(differences), max(differences.values()), what)


def _as_a_sees_them(parts: list[Tensors], shapes: dict[str, tuple[int, ...]]
                    ) -> list[Tensors]:
    """Each rank's outputs standing for A's: A's shape, or slices joined in rank order."""
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


@dataclass
class GradVerdict:
    """One rank's verdict on a module's gradient shards, and digests of A's and B's."""

    module: str
    module_type: str
    result: Result
    a_digest: str
    b_digest: str


def judged_grads(a: RankRun, golden: RankRun, b: RankRun) -> list[GradVerdict]:
    """This rank's verdict on each module's gradient shards against A's and the golden's, in
    backward order."""
    def sides(module: str) -> tuple[Tensors, Tensors] | None:
        if module not in a.grads or module not in golden.grads:
            return None
        return a.grads[module], golden.grads[module]

    return _grad_verdicts(b, sides)


def judged_grads_against_trace(reference: Reference, b: RankRun) -> list[GradVerdict]:
    """This rank's verdict on each module's gradients, B's shards against A's and the golden's cut
    alike from the trace (sketched ones not judged), in backward order."""
    def sides(module: str) -> tuple[Tensors, Tensors] | None:
        key = call_key(module, 0)
        a = reference.store.get(key, "param_grad")
        golden = reference.store.get(key, "golden_param_grad") if reference.has_golden else {}
        cut = b.shard_of[module]
        if not a or involves_sketch(*a.values(), *golden.values()) or \
                {f"param.{name}" for name in a} != cut.keys():
            return None
        return tuple({f"param.{name}": cut[f"param.{name}"](t) for name, t in whole.items()}
                     for whole in (a, golden))

    return _grad_verdicts(b, sides)


def _grad_verdicts(b: RankRun, sides: Callable[[str], tuple[Tensors, Tensors] | None]
                   ) -> list[GradVerdict]:
    """B's verdict on each module's gradients against ``sides(module)``, latest to start first."""
    verdicts = []
    for module in sorted(b.grads, key=lambda name: -b.starts.get(name, 0)):
        found = sides(module)
        if found is None or not _same_shapes(found[0], b.grads[module]):
            continue
        a_grads, golden_grads = found
        verdicts.append(GradVerdict(module, b.module_type(module),
                                    judge_quickly(b.grads[module], golden_grads, a_grads,
                                                  "grad"),
                                    _digest(a_grads), _digest(b.grads[module])))
    return verdicts


def first_grad_divergence(everyone: list[list[GradVerdict]]
                          ) -> tuple[int, RankDivergence | None, str | None]:
    """How many modules' gradients were judged, and the first that diverges on some rank, else
    the first alike on every rank of A but not of B (only its name)."""
    count = 0
    for verdict in everyone[0]:
        found = [next((v for v in rank if v.module == verdict.module), None)
                 for rank in everyone]
        if any(v is None for v in found):
            continue
        count += 1
        diverged = [rank for rank, v in enumerate(found) if not v.result.ok]
        if diverged:
            return count, RankDivergence(verdict.module, verdict.module_type, diverged,
                                         found[diverged[0]].result), None
        if len({v.a_digest for v in found}) == 1 and len({v.b_digest for v in found}) > 1:
            return count, None, verdict.module
    return count, None, None


def _same_shapes(a: Tensors, b: Tensors) -> bool:
    return a.keys() == b.keys() and all(a[p].shape == b[p].shape for p in a)


def _digest(tensors: Tensors) -> str:
    digest = hashlib.sha256()
    for path in sorted(tensors):
        digest.update(path.encode())
        digests.update(digest, tensors[path])
    return digest.hexdigest()
