"""Stage 4 of a diagnosis: propagated errors, B's full run judged against the golden's.

B runs once, whole; each aligned module's outputs (and output gradients, and direct parameter
gradients) are compared, as they are produced, with the golden's full run under the budget A's
own rounding earns, so only the tensors of calls still in flight are held. The final output
and loss are judged the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torchparity.diagnosis.align import Alignment, Match
from torchparity.diagnosis.capture import ModuleCall, flatten_tensors, leaves
from torchparity.diagnosis.judging import joined, judge_quickly, merged, with_leaves
from torchparity.diagnosis.progress import ProgressBar
from torchparity.diagnosis.reference import Reference
from torchparity.diagnosis.report import Result, Row
from torchparity.diagnosis.run import Inputs, Options, Run, run_model
from torchparity.diagnosis.trace import FINAL


@dataclass
class Propagated:
    """One row per aligned module with its propagated results, and the final verdicts."""

    rows: list[Row]
    output: Result
    loss: Result | None


def judge_propagated(reference: Reference, alignment: Alignment, model: nn.Module,
                     inputs: Inputs, opts: Options, bar: ProgressBar) -> Propagated:
    """Run B whole and judge each aligned module's outputs and gradients as they appear."""
    done = bar.phase("B: forward" + (" and backward" if opts.backward else ""))
    tracker = _Tracker(reference, alignment)
    run = run_model(model, inputs, opts, opts.backend_b, backward=opts.backward, what="outputs",
                    keep=False, on_call=tracker.on_call, on_grad=tracker.on_grad)
    tracker.finish(run.param_grads)
    done()
    rows = []
    for match in alignment.matches:
        row = new_row(match)
        row.propagated = tracker.forward.get(id(match))
        row.grad_propagated = tracker.grads.get(id(match))
        rows.append(row)
    return Propagated(rows=rows, output=_final(reference, run, "output"),
                      loss=_final(reference, run, "loss") if run.loss is not None else None)


def new_row(match: Match) -> Row:
    """An empty row for an aligned module (named after B's first call of it)."""
    first_b = min(match.b, key=lambda c: c.start)
    return Row(module=match.b_name, a_module=match.a_name, how=match.how,
               module_type="+".join(c.module_type for c in match.b), depth=first_b.depth,
               start=first_b.start)


def one_to_one(match: Match) -> bool:
    """Whether one call of A matches one call of B (not a fused group)."""
    return len(match.a) == 1 and len(match.b) == 1


class _Tracker:
    """Compares B's outputs and output gradients with the reference while B runs."""

    def __init__(self, reference: Reference, alignment: Alignment) -> None:
        self.reference = reference
        self.by_b_key = {c.key: m for m in alignment.matches for c in m.b}
        self.forward: dict[int, Result] = {}
        self.grads: dict[int, Result] = {}
        self._parts: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        self._pending_grads: dict[int, dict[str, torch.Tensor]] = {}
        self._expected_grads = {
            id(m): reference.store.paths(m.a[0].key, "grad_out")
            for m in alignment.matches if one_to_one(m)
        }

    def on_call(self, call: ModuleCall) -> None:
        match = self.by_b_key.get(call.key)
        if match is None:
            return
        parts = self._parts.setdefault(id(match), {})
        parts[call.key] = {p: t.cpu() for p, t in call.outputs.items()}
        if len(parts) == len(match.b):  # a fused group is complete with its last member
            candidate = joined([parts[c.key] for c in match.b])
            result = self.reference.judge(match.a, candidate, "out", "golden_out", "forward",
                                          quick=True)
            self.forward[id(match)] = with_leaves(result, leaves(call.output, "output"))
            del self._parts[id(match)]

    def on_grad(self, call: ModuleCall, path: str, grad: torch.Tensor) -> None:
        match = self.by_b_key.get(call.key)
        if match is None or not one_to_one(match):
            return
        pending = self._pending_grads.setdefault(id(match), {})
        pending[path] = grad.cpu()
        if set(pending) >= self._expected_grads[id(match)]:
            self._judge_output_grads(match)

    def _judge_output_grads(self, match: Match) -> None:
        candidate = self._pending_grads.pop(id(match))
        self.grads[id(match)] = self.reference.judge(match.a, candidate, "grad_out",
                                                     "golden_grad_out", "grad", quick=True)

    def finish(self, param_grads: dict[str, dict[str, torch.Tensor]]) -> None:
        """Judge gradients still pending (outputs some of whose parts got none) and add the
        parameter gradients of each one-to-one match."""
        for match in self.by_b_key.values():
            if id(match) in self._pending_grads:
                self._judge_output_grads(match)
        for match in {id(m): m for m in self.by_b_key.values()}.values():
            b = match.b[0]
            if not one_to_one(match) or b.call != 0 or not param_grads.get(b.name):
                continue
            candidate = {p: g.cpu() for p, g in param_grads[b.name].items()}
            params = self.reference.judge(match.a, candidate, "param_grad", "golden_param_grad",
                                          "grad", quick=True)
            self.grads[id(match)] = merged(self.grads.get(id(match)), params)


def _final(reference: Reference, run: Run, which: str) -> Result:
    final = flatten_tensors(run.output)
    if which == "loss":
        final = {"loss": run.loss}
    final = {p: t.cpu() for p, t in final.items()}
    golden = reference.store.get(FINAL, "golden_out") if reference.has_golden else {}
    baseline = reference.store.get(FINAL, "out")

    def pick(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {p: t for p, t in tensors.items() if (p == "loss") == (which == "loss")}

    kind = "loss" if which == "loss" else "forward"
    result = judge_quickly(final, pick(golden), pick(baseline), kind)
    return with_leaves(result, leaves(run.output, "output"))
