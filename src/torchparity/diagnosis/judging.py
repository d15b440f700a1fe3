"""Judgement of one call's tensors under the tolerance model, shared by every stage that
compares (propagated and local errors, decoding steps)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from torchparity.comparison import Comparison, StructureMismatch, compare
from torchparity.diagnosis.report import Mismatch, Result


def judge(candidate: dict[str, torch.Tensor], golden: dict[str, torch.Tensor],
          baseline: dict[str, torch.Tensor], kind: str) -> Result:
    """Compare under the tolerance model; without a golden, the baseline serves as golden and
    the analytic bound as budget. Tensors on one side only are differences of structure
    (``result.structure``), judged apart from the shared ones. A baseline in another dtype than
    the candidate's (B runs in another precision than A) cannot earn a budget and is dropped."""
    original = baseline or golden
    if not golden:
        golden, baseline = baseline, {}
    same_dtypes = all(candidate[p].dtype == t.dtype for p, t in baseline.items()
                      if p in candidate)
    try:
        result = compare(candidate, golden, baseline if baseline and same_dtypes else None, kind)
    except StructureMismatch as exc:
        return Mismatch(kind, str(exc))
    result.structure = tuple(_as_a_sees_it(d, original)
                             for d in getattr(result, "structure", ()))
    return result


def _as_a_sees_it(difference: Any, a_tensors: dict[str, torch.Tensor]) -> Any:
    """The tensors are keyed by their flattened path already: name the difference by it, and
    describe A's side by A's own tensor where the golden holds a float64 copy of it."""
    path = _flat_path(difference.path)
    a_side = _describe(a_tensors[path]) if path in a_tensors else difference.golden
    return dataclasses.replace(difference, path=path, golden=a_side)


def with_leaves(result: Result, candidate_leaves: dict[str, Any]) -> Result:
    """``result`` with each structure difference that found no tensor in the candidate saying
    what the candidate holds there instead (``None``, a cache), from its pytree's leaves."""
    structure = getattr(result, "structure", ())
    if not structure:
        return result
    result.structure = tuple(
        dataclasses.replace(d, candidate=_describe(candidate_leaves[d.path]))
        if d.candidate == "missing" and d.path in candidate_leaves else d
        for d in structure)
    return result


def _describe(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"Tensor{tuple(leaf.shape)} {str(leaf.dtype).removeprefix('torch.')}"
    if leaf is None or isinstance(leaf, (bool, int, float, str)):
        return repr(leaf)
    return type(leaf).__name__


def _flat_path(path: str) -> str:
    """``outputs["output.1"]`` -> ``output.1``."""
    found = re.fullmatch(r'outputs\["(.*)"\]', path)
    return found.group(1) if found else path


def merged(first: Result | None, second: Result) -> Result:
    """One result holding the tensors of both (a mismatch in either wins)."""
    if first is None or isinstance(second, Mismatch):
        return second
    if isinstance(first, Mismatch):
        return first
    return Comparison(kind=first.kind, tensors=first.tensors + second.tensors)


def joined(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One call's tensors as they are; several calls' single outputs concatenated along the
    last dimension (the output of the fused module they correspond to)."""
    if len(parts) == 1:
        return parts[0]
    if any(len(p) != 1 for p in parts):
        return {}
    return {"output": torch.cat([next(iter(p.values())) for p in parts], dim=-1)}
