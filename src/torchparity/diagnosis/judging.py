"""Judgement of one call's tensors under the tolerance model, shared by every stage that
compares (propagated and local errors, decoding steps)."""

from __future__ import annotations

import torch

from torchparity.comparison import Comparison, StructureMismatch, compare
from torchparity.diagnosis.report import Mismatch, Result


def judge(candidate: dict[str, torch.Tensor], golden: dict[str, torch.Tensor],
          baseline: dict[str, torch.Tensor], kind: str) -> Result:
    """Compare under the tolerance model; without a golden, the baseline serves as golden and
    the analytic bound as budget. A baseline in another dtype than the candidate's (B runs in
    another precision than A) cannot earn a budget and is dropped."""
    if not golden:
        golden, baseline = baseline, {}
    same_dtypes = all(p in candidate and candidate[p].dtype == t.dtype
                      for p, t in baseline.items())
    try:
        return compare(candidate, golden, baseline if baseline and same_dtypes else None, kind)
    except StructureMismatch as exc:
        return Mismatch(kind, str(exc))


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
