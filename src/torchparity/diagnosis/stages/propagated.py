"""Stages 3 and 4 of a diagnosis: B aligned with A, and propagated errors, B's full run judged
against the golden's.

B runs once, whole; each aligned module's outputs and gradients are judged as they are made,
under the budget A's rounding earns, so only calls in flight are held. At a decoding step
B's calls are captured first (:func:`judge_captured`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from torchparity.diagnosis.core.align import Alignment, NameMap, align, name_translator
from torchparity.diagnosis.core.capture import ModuleCall, call_key
from torchparity.diagnosis.core.decode_reference import StepReference
from torchparity.diagnosis.core.judging import (
    joined,
    judge_quickly,
    merged,
    module_padding,
    with_leaves,
)
from torchparity.diagnosis.core.progress import ProgressBar
from torchparity.diagnosis.core.reference import Reference, in_float64_islands
from torchparity.diagnosis.core.results import Result, Row, new_row
from torchparity.diagnosis.core.run import CapturedRun, Options, run_model
from torchparity.diagnosis.core.state import StateRecorder
from torchparity.diagnosis.core.trace import FINAL
from torchparity.subject.running import Inputs
from torchparity.subject.trees import flatten_tensors, leaves


@dataclass
class Propagated:
    """B's calls aligned with A's, a row per aligned module, and the final verdicts."""

    alignment: Alignment
    rows: list[Row]
    output: Result
    loss: Result | None
    changing: set[str]  # B's modules that change their own state across calls


#: Which of A's calls (and how many of B's, fused) a call of B is judged against, by B's key.
Pairing = Callable[[str], "tuple[tuple[ModuleCall, ...], tuple[str, ...]] | None"]


def judge_propagated(reference: Reference, model: nn.Module, inputs: Inputs,
                     opts: Options, bar: ProgressBar) -> Propagated:
    """Run B whole and judge each aligned module's outputs and gradients as they appear; B runs
    again only where the alignment pairs by order or fusion, which names cannot tell."""
    translate = name_translator(opts.name_map)
    by_name: dict[str, ModuleCall] = {}
    for call in sorted(reference.calls, key=lambda c: c.order):
        by_name.setdefault(call_key(translate(call.name), call.call), call)

    def named(b_key: str) -> tuple[tuple[ModuleCall, ...], tuple[str, ...]] | None:
        return ((by_name[b_key],), (b_key,)) if b_key in by_name else None

    tracker, run = _run(reference, model, inputs, opts, bar, named)
    alignment = align(reference.calls, run.calls, opts.name_map)
    if any(m.how in ("order", "fused") for m in alignment.matches):
        groups = {c.key: (m.a, tuple(b.key for b in m.b)) for m in alignment.matches
                  for c in m.b}
        tracker, run = _run(reference, model, inputs, opts, bar, groups.get)
    rows = []
    for match in alignment.matches:
        row = new_row(match)
        row.propagated = tracker.forward.get(match.b_name)
        row.grad_propagated = tracker.grads.get(match.b_name)
        rows.append(row)
    return Propagated(alignment=alignment, rows=rows, output=_final(reference, run, "output"),
                      loss=_final(reference, run, "loss") if run.loss is not None else None,
                      changing=run.changing)


def judge_captured(reference: StepReference, calls_b: list[ModuleCall],
                   name_map: NameMap | None) -> tuple[Alignment, list[Row]]:
    """B's calls at a decoding step aligned with A's: outputs against the golden's, and (one to
    one) inputs against A's under their dtype's analytic budget."""
    alignment = align(reference.calls, calls_b, name_map)
    rows = []
    for match in alignment.matches:
        row = new_row(match)
        row.propagated = reference.judge(match.a, joined([c.outputs for c in match.b]), "out",
                                         "golden_out", "forward")
        if match.one_to_one:  # inputs within A's rounding of A's: the analytic budget
            row.inputs = reference.judge_inputs(match.a[0], match.b[0].inputs)
        rows.append(row)
    return alignment, rows


def _run(reference: Reference, model: nn.Module, inputs: Inputs, opts: Options,
         bar: ProgressBar, pairing: Pairing) -> tuple[_Tracker, CapturedRun]:
    done = bar.phase("B: forward" + (" and backward" if opts.backward else ""))
    tracker = _Tracker(reference, pairing)
    states = StateRecorder(model, snapshots=False)
    with in_float64_islands(model) as islands:
        if islands is not None:  # B's own, judged as they are found
            reference.b_islands.append(islands)
        run = run_model(model, inputs, opts, opts.backend_b, backward=opts.backward,
                        what="outputs", keep=False, live=True, on_call=tracker.on_call,
                        on_grad=tracker.on_grad, states=states)
    tracker.finish(run.param_grads)
    done()
    return tracker, run


class _Tracker:
    """Judges B's outputs and output gradients while B runs, keyed by the group's name in B."""

    def __init__(self, reference: Reference, pairing: Pairing) -> None:
        self.reference = reference
        self.pairing = pairing
        self.forward: dict[str, Result] = {}
        self.grads: dict[str, Result] = {}
        self._parts: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
        self._pending_grads: dict[str, dict[str, torch.Tensor]] = {}
        self._expected_grads: dict[str, set[str]] = {}
        self._one_to_one: dict[str, ModuleCall] = {}  # B's key -> A's call

    def on_call(self, call: ModuleCall) -> None:
        paired = self.pairing(call.key)
        if paired is None:
            return
        a_calls, b_keys = paired
        name = "+".join(b_keys)
        if len(a_calls) == len(b_keys) == 1:
            self._one_to_one[call.key] = a_calls[0]
        parts = self._parts.setdefault(name, {})
        # A member of a fused group waits for the rest: a copy, which the model cannot change.
        waits = len(parts) + 1 < len(b_keys)
        parts[call.key] = {p: t.to("cpu", copy=waits) for p, t in call.outputs.items()}
        if len(parts) == len(b_keys):  # a fused group is complete with its last member
            candidate = joined([parts[key] for key in b_keys])
            result = self.reference.judge(a_calls, candidate, "out", "golden_out", "forward",
                                          quick=True)
            self.forward[name] = with_leaves(result, leaves(call.output, "output"))
            del self._parts[name]

    def on_grad(self, call: ModuleCall, path: str, grad: torch.Tensor) -> None:
        a = self._one_to_one.get(call.key)
        if a is None:
            return
        if call.key not in self._expected_grads:
            # Read as its judgement will read them next (a trace keeps the call's last read).
            self._expected_grads[call.key] = set(self.reference.store.get(a.key,
                                                                          "judged_grad_out"))
        pending = self._pending_grads.setdefault(call.key, {})
        pending[path] = grad.cpu()
        if set(pending) >= self._expected_grads[call.key]:
            self._judge_output_grads(call.key)

    def _judge_output_grads(self, b_key: str) -> None:
        candidate = self._pending_grads.pop(b_key)
        self.grads[b_key] = self.reference.judge((self._one_to_one[b_key],), candidate,
                                                 "judged_grad_out", "golden_grad_out", "grad",
                                                 quick=True)

    def finish(self, param_grads: dict[str, dict[str, torch.Tensor]]) -> None:
        """Judge pending gradients and add each one-to-one pair's parameter gradients."""
        for b_key in list(self._pending_grads):
            self._judge_output_grads(b_key)
        for b_key, a in self._one_to_one.items():
            if "#" in b_key or not param_grads.get(b_key):
                continue
            candidate = {p: g.cpu() for p, g in param_grads[b_key].items()}
            params = self.reference.judge((a,), candidate, "param_grad", "golden_param_grad",
                                          "grad", quick=True)
            self.grads[b_key] = merged(self.grads.get(b_key), params)


def _final(reference: Reference, run: CapturedRun, which: str) -> Result:
    final = flatten_tensors(run.output)
    # A loss carries the rounding of the outputs it is computed from.
    precision = next((t.dtype for t in final.values() if t.is_floating_point()), None)
    if which == "loss":
        final = {"loss": run.loss}
    final = {p: t.cpu() for p, t in final.items()}
    golden = reference.store.get(FINAL, "golden_out") if reference.has_golden else {}
    baseline = reference.store.get(FINAL, "out")

    def pick(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {p: t for p, t in tensors.items() if (p == "loss") == (which == "loss")}

    kind = "loss" if which == "loss" else "forward"
    result = judge_quickly(final, pick(golden), pick(baseline), kind,
                           module_padding(reference.padding, ""),
                           precision if which == "loss" else None,
                           islands=reference.islands_of())
    return with_leaves(result, leaves(run.output, "output"))
