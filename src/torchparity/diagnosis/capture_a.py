"""Stage 1 of a diagnosis: the reference side, model A's calls and where their tensors are.

In one process A runs once with every selected module's inputs, outputs and output gradients
kept in a store (memory, or a trace directory on disk with ``stream``/``record``); across
revisions the reference is read back from the trace :func:`torchparity.record` wrote. Its float64
golden is added by :mod:`torchparity.diagnosis.float64_golden`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchparity.diagnosis.capture import ModuleCall, PatternSpec, Signature, call_key, signature
from torchparity.diagnosis.judging import joined, judge, judge_quickly, module_padding
from torchparity.diagnosis.progress import ProgressBar
from torchparity.diagnosis.results import Result
from torchparity.diagnosis.run import Options, Run, run_model
from torchparity.diagnosis.state import OwnState, StateRecorder
from torchparity.diagnosis.trace import (
    FINAL,
    SCHEMA,
    call_from_json,
    call_to_json,
    inputs_digest,
    module_tree,
    open_trace,
    weight_digests,
)
from torchparity.errors import UsageError
from torchparity.subject.padding import Padding
from torchparity.subject.running import Inputs
from torchparity.subject.trees import flatten_tensors


@dataclass
class Reference:
    """A's recorded calls and where their tensors are; ``golden`` says which golden was used
    (it starts with "none" when there is none); ``notes`` why some calls cannot be replayed.
    ``replayer`` replays a call of A and the golden on demand (None when every call was
    replayed already, as in a trace)."""

    calls: list[ModuleCall]
    store: Any
    golden: str = "none: not made yet"
    mode: str = ""
    notes: dict[str, str] = field(default_factory=dict)
    source: str = "in-process"
    replayer: Callable[[ModuleCall], None] | None = None
    replayed: set[str] = field(default_factory=set)
    judging_seconds: float = 0.0  # spent judging B's tensors while B runs (``quick``)
    padding: Padding = field(default_factory=Padding)  # positions no judgement counts
    signatures: dict[str, Signature | None] = field(default_factory=dict)  # A's forwards
    #: Modules that change their own state across calls: name -> (clock, state before a call).
    states: dict[str, list[tuple[int, OwnState]]] = field(default_factory=dict)

    def ensure_replayed(self, call: ModuleCall) -> None:
        """The local golden (and local gradients) of ``call`` are in the store after this."""
        if self.replayer is not None and call.key not in self.replayed:
            self.replayer(call)
            self.replayed.add(call.key)

    def replay_all(self, bar: ProgressBar) -> None:
        """Replay every call now (a trace must serve any later candidate)."""
        advance = bar.phase("A and golden: module replays", total=len(self.calls))
        for call in self.calls:
            self.ensure_replayed(call)
            advance()

    @property
    def has_golden(self) -> bool:
        return not self.golden.startswith("none")

    def tensors(self, calls: tuple[ModuleCall, ...], group: str) -> dict[str, torch.Tensor]:
        return joined([self.store.get(c.key, group) for c in calls])

    def judge(self, calls: tuple[ModuleCall, ...], candidate: dict[str, torch.Tensor],
              baseline_group: str, golden_group: str, kind: str, *, quick: bool = False
              ) -> Result:
        """``candidate`` against the golden's ``golden_group`` of ``calls``, with A's
        ``baseline_group`` as the baseline; ``quick`` bounds clearly-within verdicts instead
        of computing every metric (:func:`~torchparity.diagnosis.judging.judge_quickly`).
        Padded positions of the module's tensors are left out (parameter gradients have
        none)."""
        start = time.perf_counter()
        golden = self.tensors(calls, golden_group) if self.has_golden else {}
        padding = None if baseline_group == "param_grad" else \
            module_padding(self.padding, calls[0].name)
        result = (judge_quickly if quick else judge)(
            candidate, golden, self.tensors(calls, baseline_group), kind, padding)
        if quick:
            self.judging_seconds += time.perf_counter() - start
        return result


def capture_reference(model: nn.Module, inputs: Inputs, store: Any, opts: Options,
                      bar: ProgressBar) -> Reference:
    """Run A once, keeping each selected call's inputs, outputs and output gradients in
    ``store``, and the final output, loss and parameter gradients."""
    def keep_call(call: ModuleCall) -> None:
        store.put_inputs(call.key, call.args, call.kwargs)
        store.put(call.key, "out", call.outputs)

    store.padding = opts.padding  # sketches of padded tensors leave the padding out
    done = bar.phase("A: forward" + (" and backward" if opts.backward else ""))
    recorder = StateRecorder(model)
    run = run_model(model, inputs, opts, opts.backend_a, backward=opts.backward, what="tensors",
                    keep=False, live=True, on_call=keep_call,
                    on_grad=grad_keeper(store, "grad_out", "judged_grad_out"), states=recorder)
    keep_run_results(store, run, "out", "param_grad")
    states = recorder.kept()
    for name, history in states.items():  # a trace keeps them for replays on another revision
        for clock, state in history:
            store.put_inputs(state_key(name, clock), (), state)
    done()
    return Reference(calls=run.calls, store=store, padding=opts.padding, states=states,
                     signatures={name: signature(module)
                                 for name, module in model.named_modules()})


def state_key(name: str, clock: int) -> str:
    """Where a module's state before one of its calls is stored."""
    return f"state|{name}@{clock}"


def grad_keeper(store: Any, *groups: str) -> Callable[[ModuleCall, str, torch.Tensor], None]:
    """An ``on_grad`` callback that puts each output gradient into every one of ``groups`` of
    its call (each keeps it its own way: exact, or sketched when big)."""
    return lambda call, path, grad: store.put_all([(call.key, group, {path: grad})
                                                   for group in groups])


def keep_run_results(store: Any, run: Run, out_group: str, param_group: str) -> None:
    """Store a run's final output and loss (under the pseudo-call FINAL) and each module's
    direct parameter gradients."""
    final = flatten_tensors(run.output)
    if run.loss is not None:
        final["loss"] = run.loss
    store.put(FINAL, out_group, final)
    for name, grads in run.param_grads.items():
        if grads:
            store.put(call_key(name, 0), param_group, grads)


# --------------------------------------------------------------------------------------------
# Traces: the reference side on disk


def trace_meta(reference: Reference, model: nn.Module, inputs: Inputs, opts: Options,
               dtype: torch.dtype | None) -> dict[str, Any]:
    """What a trace's ``trace.json`` says besides its tensors (``model`` and ``inputs`` as the
    user gave them, before any cast to ``dtype``)."""
    import torchparity

    return {
        "schema": SCHEMA,
        "torchparity": torchparity.__version__,
        "torch": torch.__version__,
        "model": type(model).__name__,
        "golden": reference.golden,
        "mode": reference.mode,
        "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
        "backward": opts.backward,
        "backend": opts.backend_a,
        "include": pattern_json(opts.include),
        "exclude": pattern_json(opts.exclude),
        "inputs_digest": inputs_digest(inputs),
        "weights": weight_digests(model),
        "modules": module_tree(model),
        "calls": [call_to_json(c) for c in reference.calls],
        "signatures": reference.signatures,
        "states": {name: [clock for clock, _ in history]
                   for name, history in reference.states.items()},
        "notes": reference.notes,
        "padding": reference.padding.to_json(),
    }


def pattern_json(spec: PatternSpec) -> Any:
    """A module selection as a trace stores it (globs and ``re:`` strings only)."""
    if spec is None or isinstance(spec, str):
        return spec
    if isinstance(spec, (list, tuple)) and all(isinstance(p, str) for p in spec):
        return list(spec)
    raise UsageError("record() stores the module selection in the trace: pass include/exclude "
                     "as glob or 're:' strings, not compiled patterns or callables")


def open_reference(path: str | Path) -> tuple[Reference, dict[str, Any]]:
    """The reference side a trace of a forward pass holds (every call already replayed), and
    its metadata (:func:`~torchparity.diagnosis.api.diagnose_against` sends a decoding trace to
    the decoding pipeline)."""
    meta, store = open_trace(path)
    reference = Reference(calls=[call_from_json(c) for c in meta["calls"]], store=store,
                          golden=meta["golden"], mode=meta["mode"], notes=meta["notes"],
                          source=str(path), signatures=meta["signatures"],
                          states={name: [(clock, store.get_inputs(state_key(name, clock))[1])
                                         for clock in clocks]
                                  for name, clocks in meta["states"].items()})
    if meta.get("padding"):
        reference.padding = Padding.from_json(meta["padding"])
    return reference, meta
