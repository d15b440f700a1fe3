"""Judging a decoding: each step's logits, the modules at the first step that leaves its budget,
where the change enters there, and the first token flip of each sequence with its verdict.

Every side is fed the same tokens, so each step's next-token logits of B are judged against the
golden's (A's float64 copy) with A's as the baseline, under the tolerance model. At the first
step that breaks its budget, B's module outputs of that step are judged the same way; the first
module whose output breaks its budget while its inputs do not is where B computes something
else, and comparing its arguments and the state it read (a cache) with A's says how the change
gets in.

A *token flip* is a step where B's greedy choice differs from A's. It is a ``near tie`` when
legitimate noise explains it (regenerating the golden is safe) and a ``real change`` when B
computes something else: B's own float64 decoding, along the same tokens, prefers another
token than the golden (A in float64) does, beyond float64 rounding, so the flip would happen
without any rounding noise too. Without a float64 B the margin decides: a flip over a margin
larger than twice the step's budget cannot come from noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from torchparity import tolerance
from torchparity.diagnosis.align import NameMap, align
from torchparity.diagnosis.arguments import argument_difference, argument_path
from torchparity.diagnosis.capture import ModuleCall, signature
from torchparity.diagnosis.decode_reference import DecodeReference, flat_inputs, step_key
from torchparity.diagnosis.judging import joined, judge
from torchparity.diagnosis.results import Entry, Mismatch, Result, Row, new_row
from torchparity.diagnosis.state import state_difference

Verdict = Literal["near tie", "real change"]


@dataclass(frozen=True)
class Flip:
    """The first step at which B's greedy token differs from A's in one sequence: A's margin
    (its top-1 minus top-2 logit), B's change there (the largest error of B's logits of that
    sequence against the golden), the step's noise budget, and the verdict."""

    step: int
    sequence: int
    a_token: int
    b_token: int
    margin: float
    change: float
    budget: float | None
    verdict: Verdict

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "sequence": self.sequence, "a_token": self.a_token,
                "b_token": self.b_token, "margin": self.margin, "change": self.change,
                "budget": self.budget, "verdict": self.verdict}


def judge_steps(reference: DecodeReference, logits: list[torch.Tensor]) -> list[Result]:
    """B's next-token logits of every step against the golden's, A's as the baseline."""
    results = []
    for step, candidate in enumerate(logits):
        golden = {"logits": reference.golden_logits[step]} if reference.has_golden else {}
        results.append(judge({"logits": candidate}, golden, {"logits": reference.logits[step]},
                             "forward"))
    return results


def step_budget(result: Result) -> float | None:
    """The budget of a step's logits (None when they could not be judged)."""
    tensors = getattr(result, "tensors", [])
    return tensors[0].budget.value if tensors and tensors[0].budget is not None else None


def step_error(result: Result) -> float | None:
    tensors = getattr(result, "tensors", [])
    return tensors[0].error if tensors else None


# --------------------------------------------------------------------------------------------
# Modules at one step


def module_rows(reference: DecodeReference, step: int, calls_b: list[ModuleCall],
                name_map: NameMap | None, *, cut: bool = False) -> tuple[list[Row], list[str]]:
    """Each aligned module's output at ``step``, B against the golden with A as the baseline,
    and (one to one) its inputs against A's under the analytic budget of their dtype; and
    notes on calls left unmatched. With ``cut`` A's tensors
    (a full recompute) are cut to B's positions (a cached step's new tokens)."""
    alignment = align(reference.calls.get(step, []), calls_b, name_map)
    store = reference.store
    rows = []
    for match in alignment.matches:
        keys = [step_key(c.key, step) for c in match.a]
        row = new_row(match)
        golden = joined([store.get(k, "golden_out") for k in keys]) if reference.has_golden \
            else {}
        row.propagated = _compare(joined([c.outputs for c in match.b]),
                                  joined([store.get(k, "out") for k in keys]), golden, cut)
        if match.one_to_one:  # inputs within A's rounding of A's: the analytic budget
            row.inputs = _compare(match.b[0].inputs, {}, flat_inputs(store, keys[0]), cut,
                                  common_only=True)
        rows.append(row)
    notes = [f"unmatched in {side} at step {step}: {', '.join(c.key for c in calls)}"
             for side, calls in (("A", alignment.unmatched_a), ("B", alignment.unmatched_b))
             if calls]
    return rows, notes


def first_module(rows: list[Row]) -> Row | None:
    """The first row (in the order B's calls finished) whose output breaks its budget while
    its inputs do not (or cannot be judged); else the first that breaks it."""
    broken = [r for r in rows if r.propagated is not None and not r.propagated.ok]
    origin = (r for r in broken if r.inputs is None or r.inputs.ok)
    return next(origin, broken[0] if broken else None)


def where_it_enters(reference: DecodeReference, step: int, row: Row, calls_b: list[ModuleCall],
                    model_b: nn.Module) -> Entry | None:
    """How the change gets into ``row``'s module at ``step``: an argument whose value differs
    from A's by meaning, else the first state it read (a cache, on the module or in an object
    it was handed) that holds other positions than A's, else an argument only one side
    passes that reads otherwise in the other; when none differs, the module's own code."""
    a = next((c for c in reference.calls.get(step, []) if c.key == row.a_module), None)
    b = next((c for c in calls_b if c.key == row.module), None)
    if a is None or b is None:
        return None
    label = f"{row.module} @ step {step}"
    module_b = model_b.get_submodule(b.name)
    b_signature = signature(module_b)
    a_inputs = reference.store.get_inputs(step_key(a.key, step), placeholders=True)
    found = argument_difference(reference.signatures.get(a.name), a_inputs, b_signature,
                                (b.args, b.kwargs), b_module=module_b)
    held = state_difference(a.state, b.state)
    if found is not None and (held is None or not found.one_sided):
        return Entry(label, found.argument, found.detail)
    if held is None:
        return Entry(label, "", "its arguments and the state it reads are A's", via="code")
    path, detail = held
    if path.startswith("state."):
        return Entry(label, path.removeprefix("state."), detail, via="state")
    return Entry(label, argument_path(path, b_signature), detail)


def _compare(candidate: dict[str, torch.Tensor], baseline: dict[str, torch.Tensor],
             golden: dict[str, torch.Tensor], cut: bool, *, common_only: bool = False) -> Result:
    """Judge one step's tensors (with ``cut``, baseline and golden cut to the candidate's
    positions first). With ``common_only`` tensors on one side only are left out (a mask a
    recompute hands the kernel, an argument B renamed)."""
    candidate = {p: t.cpu() for p, t in candidate.items()}
    if cut:
        baseline, golden = _trailing(baseline, candidate), _trailing(golden, candidate)
        for part in (baseline, golden):
            if isinstance(part, Mismatch):
                return part
    if common_only:
        paths = set(candidate)
        for side in (baseline, golden):
            paths &= side.keys() if side else paths
        candidate = {p: t for p, t in candidate.items() if p in paths}
        baseline = {p: t for p, t in baseline.items() if p in paths}
        golden = {p: t for p, t in golden.items() if p in paths}
    return judge(candidate, golden, baseline, "forward")


def _trailing(tensors: dict[str, torch.Tensor], like: dict[str, torch.Tensor]
              ) -> dict[str, torch.Tensor] | Mismatch:
    """``tensors`` cut to ``like``'s shapes by keeping the last positions of the one dimension
    in which they are longer (a recompute's whole sequence against a cached step's new tokens)."""
    out = {}
    for path, tensor in tensors.items():
        target = like.get(path)
        if target is None or target.shape == tensor.shape:
            out[path] = tensor.cpu()
            continue
        longer = [d for d in range(tensor.dim()) if tensor.shape[d] != target.shape[d]]
        if tensor.dim() != target.dim() or len(longer) != 1 or \
                tensor.shape[longer[0]] < target.shape[longer[0]]:
            return Mismatch("forward", f"{path}: shape {tuple(tensor.shape)} cannot be cut to "
                                       f"{tuple(target.shape)}")
        dim = longer[0]
        out[path] = tensor.narrow(dim, tensor.shape[dim] - target.shape[dim], target.shape[dim])
    return out


# --------------------------------------------------------------------------------------------
# Token flips


def first_flips(reference: DecodeReference, logits: list[torch.Tensor], steps: list[Result],
                logits64: list[torch.Tensor] | None) -> list[Flip]:
    """Per sequence, the first step where B's greedy token differs from A's, with its verdict
    (``logits64``: B's float64 decoding along the same tokens, None without one)."""
    flips = []
    for sequence in range(logits[0].shape[0]):
        for step, (a_row, b_row) in enumerate(zip((t[sequence] for t in reference.logits),
                                                  (t[sequence] for t in logits), strict=True)):
            a_token, b_token = int(a_row.argmax()), int(b_row.argmax())
            if a_token == b_token:
                continue
            golden = reference.golden_logits[step][sequence] if reference.has_golden else a_row
            top = a_row.double().topk(2).values
            budget = step_budget(steps[step])
            flips.append(Flip(
                step=step, sequence=sequence, a_token=a_token, b_token=b_token,
                margin=float(top[0] - top[1]), change=_change(b_row, golden), budget=budget,
                verdict=flip_verdict(a_row, golden, a_token, b_token, budget,
                                 None if logits64 is None else logits64[step][sequence])))
            break
    return flips


def _change(row: torch.Tensor, golden: torch.Tensor) -> float:
    """The largest difference of one sequence's logits from the golden's, masked entries
    (banned tokens) left out."""
    judged = (row > tolerance.MASKED_BELOW) & (golden > tolerance.MASKED_BELOW)
    return float((row.double() - golden.double())[judged].abs().max()) if judged.any() else 0.0


def flip_verdict(a_row: torch.Tensor, golden: torch.Tensor, a_choice: int, b_choice: int,
                 budget: float | None, row64: torch.Tensor | None,
                 among: tuple[int, ...] | None = None) -> Verdict:
    """``real change`` when B's float64 scores ``row64`` prefer another of the candidates
    ``among`` (default: all) than the golden's choice among them beyond float64 rounding (the
    flip happens without fp32 noise too); without them, when A's margin of ``a_choice`` over
    ``b_choice`` exceeds what twice the step's budget can swing."""
    if row64 is not None:
        row64 = row64.double()
        candidates = torch.tensor(among) if among is not None else torch.arange(len(golden))
        chosen = int(candidates[golden.double()[candidates].argmax()])  # A without noise
        judged = row64[row64 > tolerance.MASKED_BELOW]
        tie = tolerance.budget(judged, baseline_error=None, compute_dtype="fp64").value
        others = row64[candidates[candidates != chosen]]
        return "real change" if float(others.max() - row64[chosen]) > tie else "near tie"
    margin = float(a_row[a_choice].double() - a_row[b_choice].double())
    return "near tie" if budget is not None and margin <= 2 * budget else "real change"
